"""Multi-process training and kill-and-resume, each against an uninterrupted single process.

Both start real subprocesses (`tests/learner_helpers.py` workers wired by `jax.distributed`
with gloo CPU collectives; `python -m jaxgrpo.train`, killed with SIGKILL), so both are slow.
Subprocesses share a persistent compilation cache so a resumed run does not compile again.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import learner_helpers
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PARAM_ATOL = 1e-5  # float32; 4 devices over 2 processes reduce in another order than 1 device
TIMEOUT_S = 600


def _env(cache_dir, devices: int | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_with_single_process(tmp_path):
    out = tmp_path / "params.npz"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(TESTS, "learner_helpers.py"),
                "--process_id",
                str(i),
                "--num_processes",
                "2",
                "--coordinator",
                f"localhost:{port}",
                "--steps",
                "2",
                "--out",
                str(out),
            ],
            env=_env(tmp_path / "cache", devices=2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    learner, task = learner_helpers.build({"data": 1}, devices=jax.devices()[:1])
    want_params, want_metrics = learner_helpers.run_steps(learner, task, 2)
    for p in procs:
        log, _ = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, log[-4000:]
    got = np.load(out)
    got_params = [got[f"arr_{i}"] for i in range(len(got.files))]
    assert len(got_params) == len(want_params)
    for g, w in zip(got_params, want_params, strict=True):
        np.testing.assert_allclose(g, w, atol=PARAM_ATOL)
    got_metrics = json.loads((tmp_path / "params.npz.json").read_text())
    for g, w in zip(got_metrics, want_metrics, strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "kl/mean"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key


RESUME_CONFIG = """
from jaxgrpo.configs import tiny


def get_config():
    c = tiny.get_config()
    c.steps = 4
    c.checkpoint.every = 1
    c.task.num_eval = 0
    c.rewards.functions = (("learner_helpers.text_reward", 1.0),)
    return c
"""


def _train(config, run_dir, env):
    cmd = [
        sys.executable,
        "-m",
        "jaxgrpo.train",
        "--config",
        str(config),
        f"--config.run_dir={run_dir}",
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )


def _metrics(run_dir) -> dict[int, dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return {row["step"]: row for row in rows}


def _comparable(row: dict) -> dict:
    """Drops wall-clock figures (times and rates): they differ between any two runs."""
    return {k: v for k, v in row.items() if not (k.startswith("time") or k.endswith("per_s"))}


@pytest.mark.slow
def test_kill_after_step_2_and_resume_equals_uninterrupted(tmp_path):
    from jaxgrpo.checkpoint import Checkpointer
    from jaxgrpo.config import load_config
    from jaxgrpo.train import build_parts

    config = tmp_path / "tiny_resume.py"
    config.write_text(RESUME_CONFIG)
    # One device per run: this test is about exact resumption, not about collectives.
    env = _env(tmp_path / "cache", devices=1)
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    full = _train(config, full_dir, env)
    victim = _train(config, killed_dir, env)
    deadline = time.monotonic() + TIMEOUT_S
    while 2 not in _metrics(killed_dir):
        assert victim.poll() is None, victim.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "run did not reach step 2"
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    assert 4 not in _metrics(killed_dir), "killed too late to test resumption"
    resumed = _train(config, killed_dir, env)
    for p in (full, resumed):
        log, _ = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, log[-4000:]
    assert "resuming" in log
    want, got = _metrics(full_dir), _metrics(killed_dir)
    table = {s: (want[s].get("reward/mean"), got.get(s, {}).get("reward/mean")) for s in want}
    why = f"reward/mean per step (uninterrupted, resumed): {table}"
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    got4, want4 = _comparable(got[4]), _comparable(want[4])
    assert sorted(got4) == sorted(want4)
    for key, value in want4.items():
        if value is None:  # NaN metrics (e.g. length of correct answers when none is) are null
            assert got4[key] is None, (key, why)
        else:
            assert got4[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (key, why)

    cfg = load_config(str(config), {"run_dir": str(tmp_path / "unused")})
    target = build_parts(cfg)["learner"].init_state()

    def final_params(run_dir):
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=1, keep=3)
        state, meta = ckpt.restore(target, 4)
        ckpt.close()
        return [np.asarray(x) for x in jax.tree.leaves(state.params)], meta

    (want_p, want_meta), (got_p, got_meta) = final_params(full_dir), final_params(killed_dir)
    assert got_meta["data_cursor"] == want_meta["data_cursor"]
    assert max(np.abs(w).max() for w in want_p) > 0
    for g, w in zip(got_p, want_p, strict=True):
        np.testing.assert_array_equal(g, w)
