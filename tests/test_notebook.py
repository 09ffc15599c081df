"""The Colab demo runs top to bottom on CPU (tiny settings) and is stored without outputs."""

import os

import pytest

NOTEBOOK = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "notebooks",
    "colab_tpu_demo.ipynb",
)


def test_notebook_is_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_notebook_executes_on_cpu_with_tiny_settings(tmp_path):
    """Runs every cell in a fresh kernel (JAXGRPO_NOTEBOOK_TINY=1: random tiny model, 3 GRPO
    steps); nbclient raises CellExecutionError on the first failing cell."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"JAXGRPO_NOTEBOOK_TINY": "1", "JAX_PLATFORMS": "cpu", "MPLBACKEND": "agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel process inherits this environment
    try:
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
        )
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = "\n".join(
        str(out.get("text", "")) + str(out.get("data", {}).get("text/markdown", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    assert "tiny: True" in text and "backend: cpu" in text
    assert "| before |" in text and "| after |" in text, text[-2000:]
    assert "config.json" in text and "model.safetensors" in text
    install = nb.cells[1]
    assert "pip_install" in install.source and not install.outputs, "install ran although installed"
