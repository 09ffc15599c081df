"""Repository hygiene: lint, the README's Quickstart contract, and import-time behaviour."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```\n(.*?)```", section, flags=re.S)]


def test_ruff_lint_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", ROOT], capture_output=True, text=True
    )
    assert proc.returncode == 0, "ruff found lint errors; fix them:\n" + proc.stdout + proc.stderr


def test_quickstart_has_exactly_two_commands_and_ci_runs_both():
    commands = _quickstart_commands()
    assert len(commands) == 2, f"Quickstart must hold exactly two commands, found {commands}"
    train_cmd, test_cmd = commands
    assert train_cmd.startswith("pip install . ")
    assert "python -m jaxgrpo.train --config format_copy.py" in train_cmd
    assert "pytest" in test_cmd and test_cmd.startswith("pip install -e")
    assert "tpu" in test_cmd, "the tests compile for TPU topologies: the tpu extra brings libtpu"
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    # .ci/run takes the first README line of each kind: the commands above, and nothing else.
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert next(x for x in lines if x.startswith("pip install . ")) == train_cmd
    assert next(x for x in lines if x.startswith("pip install -e")) == test_cmd
    assert "grep -m1 '^pip install \\. ' README.md" in ci
    assert "grep -m1 '^pip install -e' README.md" in ci


def test_import_has_no_side_effects():
    code = (
        "import sys, jaxgrpo, jaxgrpo.core.shapes; "
        "print('jax.config' in sys.modules and "
        "sys.modules['jax'].config.jax_numpy_rank_promotion)"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    # jaxgrpo.core.shapes imports jax but must leave its global configuration untouched.
    assert proc.stdout.strip() in ("False", "allow"), proc.stdout


def test_the_suites_file_lists_name_existing_tests():
    """conftest's `LONG_FILES` (run first) and `QUICK_MODULES` (the quick tier) name test files
    and folders that exist: a renamed file would silently leave the order or the tier."""
    import conftest

    tests = os.path.join(ROOT, "tests")
    for name in (*conftest.LONG_FILES, *conftest.QUICK_MODULES):
        assert os.path.exists(os.path.join(tests, name)), f"tests/conftest.py names {name}"
