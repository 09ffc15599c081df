"""``python -m jaxgrpo.export``: a trained run's checkpoint loads in transformers and peft with the
logits jaxgrpo computes on the trained weights; user mistakes end in one ``error:`` line.

The run is the tiny config trained 2 steps. Its random model's rewards are all 0 (every
advantage is 0), so an entropy bonus and a high learning rate are what move LoRA B off zero.
Tolerance: float32 logits within 1e-4 (absolute) on unpadded positions.
"""

import importlib.util
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from learner_helpers import train_tiny_run

from jaxgrpo.core import sharding
from jaxgrpo.models import SafetensorsFiles
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.run import export
from jaxgrpo.run.build import load_policy
from jaxgrpo.settings.loading import load_config, run_config
from jaxgrpo.settings.schema import resolve_mesh_shape

# Checked before the module's run is trained, so a base install skips without training.
needs_torch_peft = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "peft")),
    reason="needs torch and peft: pip install 'jaxgrpo[test]'",
)
TEXTS = ["Copy this integer exactly: 4096", "hello", "0123456789 10 20"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny LoRA run with checkpoints at steps 1 and 2."""
    return train_tiny_run(str(tmp_path_factory.mktemp("run")), steps=2)


def _export(capsys, *args):
    """(exit status, stdout, stderr) of the CLI in this process."""
    code = export.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _trained_model(run_dir):
    cfg = run_config(None, run_dir, {})
    mesh = sharding.make_mesh(resolve_mesh_shape(cfg, jax.device_count()))
    model, tokenizer, step = load_policy(cfg, run_dir, mesh)
    assert step == 2
    return model, tokenizer


def _jax_logits(model, ids, mask):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, attention_mask=mask))
    return np.asarray(forward(state))


def _torch_logits(model, ids, mask):
    import torch  # test extra, imported by the tests that skip without it

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
        )
    return out.logits.float().numpy()


@pytest.mark.slow
@needs_torch_peft
def test_merged_and_peft_exports_match_jaxgrpo(run_dir, tmp_path, capsys):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model, tokenizer = _trained_model(run_dir)
    b = [np.abs(np.asarray(v)).max() for v in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]
    assert max(b) > 1e-3, "training should move LoRA B off zero (entropy bonus, lr 0.05)"
    ids, mask = tokenizer.encode_chat([[{"role": "user", "content": t}] for t in TEXTS])
    keep = mask.astype(bool)
    ours = _jax_logits(model, ids, mask)[keep]

    code, out, _ = _export(capsys, run_dir, tmp_path / "merged")
    assert code == 0 and f"AutoModelForCausalLM.from_pretrained('{tmp_path / 'merged'}')" in out
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(merged, ids, mask)[keep], ours, atol=1e-4, rtol=0)

    code, out, _ = _export(capsys, run_dir, tmp_path / "adapter", "--peft")
    assert code == 0 and "PeftModel.from_pretrained" in out and "--step 0" in out, out
    assert _export(capsys, run_dir, tmp_path / "base", "--step", 0)[0] == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    base_logits = _torch_logits(base, ids, mask)[keep]
    assert np.abs(base_logits - ours).max() > 1e-3, "the trained adapters should move logits"
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(adapted, ids, mask)[keep], ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_step_selects_the_checkpoint(run_dir, tmp_path, capsys):
    for step in (1, 2):
        code, out, _ = _export(capsys, run_dir, tmp_path / f"s{step}", "--peft", "--step", step)
        assert code == 0 and f"step {step} of {run_dir}" in out, out
    s1, s2 = (
        SafetensorsFiles([str(tmp_path / f"s{s}" / "adapter_model.safetensors")]) for s in (1, 2)
    )
    assert s1.names() == s2.names()
    assert any(not np.array_equal(s1.get_tensor(n), s2.get_tensor(n)) for n in s1.names())


@pytest.fixture
def fake_run(tmp_path):
    """A run directory with the tiny config and placeholder checkpoints at steps 1 and 2: enough
    for every error, which is found before anything is restored."""
    path = tmp_path / "fake"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    ckpt = Checkpointer(str(path / "checkpoints"), every=1, keep=2)
    for step in (1, 2):
        ckpt.save(step, {"x": np.zeros(1, np.float32)}, {})
    ckpt.close()
    return str(path)


def _with_config(run_dir, dst, **model):
    """A copy of ``run_dir`` (config.json, checkpoints) with ``model`` keys of the config set."""
    shutil.copytree(run_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model"].update(model)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_user_errors_are_one_line(fake_run, tmp_path, capsys):
    os.makedirs(tmp_path / "new")
    shutil.copy(os.path.join(fake_run, "config.json"), tmp_path / "new")
    cases = [
        ((tmp_path, tmp_path / "o"), f"{tmp_path} is not a jaxgrpo run directory"),
        ((tmp_path / "new", tmp_path / "o"), "no checkpoint in"),
        ((fake_run, tmp_path / "o", "--step", 7), f"step 7 in {fake_run}; available: 0, 1, 2"),
        (
            (_with_config(fake_run, tmp_path / "full", lora_rank=0), tmp_path / "o", "--peft"),
            "is a full fine-tuning run (model.lora_rank = 0)",
        ),
    ]
    for args, message in cases:
        code, out, err = _export(capsys, *args)
        assert code == 2 and out == "", (args, out)
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not os.path.exists(tmp_path / "o"), "nothing written on an error"
    assert not os.path.exists(tmp_path / "new" / "checkpoints"), "nor created in the run"
