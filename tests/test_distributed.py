"""Multi-process training and kill-and-resume, each against an uninterrupted single process.

Both start real subprocesses (`tests/learner_helpers.py` workers wired by `jax.distributed`
with gloo CPU collectives; `python -m jaxgrpo.train`, killed with SIGKILL), so both are slow.
Subprocesses share a persistent compilation cache so a resumed run does not compile again.
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import jax
import learner_helpers
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxgrpo.core.host import FORCE_HOST_DEVICES_FLAG
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.run.build import build_parts
from jaxgrpo.settings.loading import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PARAM_ATOL = 1e-5  # float32; 4 devices over 2 processes reduce in another order than 1 device
TIMEOUT_S = 600


def _env(cache_dir, devices: int | None = None) -> dict:
    """The subprocesses' environment: the tests' XLA flags (conftest) with ``devices`` forced
    CPU devices in place of the tests' 8 (the launcher sets its own count when None)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith(FORCE_HOST_DEVICES_FLAG)]
    if devices is not None:
        flags.append(f"{FORCE_HOST_DEVICES_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
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
    learner, task = learner_helpers.make_learner({"data": 1}, devices=jax.devices()[:1])
    state, want_metrics = learner_helpers.run_steps(learner, list(task.train_examples(0)), 2)
    want_params = learner_helpers.host_params(state)
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

    _assert_same_step_4(config, tmp_path, full_dir, killed_dir)


MULTIHOST_CONFIG = RESUME_CONFIG.replace(
    "    return c",
    "    c.logging.tensorboard = True\n    c.logging.samples_every = 1\n    return c",
)
LAUNCHER = os.path.join(ROOT, "launch", "local_multiprocess.sh")


def _start(cmd, env, log_path):
    """Starts `cmd` as the leader of a new process group, its output in `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


def _kill_group(proc) -> None:
    """SIGKILLs `proc`'s process group (the launcher and every process it started) and waits,
    bounded, until none of them is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process group {proc.pid} survived SIGKILL")


def _wait(proc, log_path, timeout=TIMEOUT_S) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
    log = log_path.read_text()
    assert proc.returncode == 0, log[-4000:]
    return log


def _tb_scalars(run_dir) -> dict[str, list[tuple[str, int]]]:
    """{events file name: [(tag, step) of every scalar in it]}, read as TFRecords."""
    out = {}
    tb_dir = os.path.join(run_dir, "tensorboard")
    for name in sorted(os.listdir(tb_dir)):
        scalars = out[name] = []
        with open(os.path.join(tb_dir, name), "rb") as f:
            while header := f.read(12):  # uint64 length, uint32 crc; data; uint32 crc
                event = event_pb2.Event.FromString(f.read(struct.unpack("<Q", header[:8])[0]))
                f.read(4)
                scalars += [(v.tag, event.step) for v in event.summary.value]
    return out


def _assert_logs_written_once(run_dir, last: int) -> None:
    """Process 0's files, once: process 1 would write to the same run_dir (its `RunFiles` and
    `MetricsLogger` are inactive, not elsewhere), so a second writer shows as a repeated row,
    a second events file or a repeated TensorBoard scalar. Steps 1..`last` are checked."""
    steps = list(range(1, last + 1))
    assert os.path.exists(os.path.join(run_dir, "config.json"))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if r["step"] <= last] == steps, "one metrics row per step"
    samples = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "samples.jsonl"))]
    samples = [s for s in samples if s <= last]
    assert samples == [s for s in steps for _ in range(2 * 4)], "prompts x group per step"
    for name, scalars in _tb_scalars(run_dir).items():
        assert len(scalars) == len(set(scalars)), f"{name} holds scalars written twice"


@pytest.mark.slow
def test_two_process_cli_killed_and_resumed_equals_one_process(tmp_path):
    """`launch/local_multiprocess.sh 2` (one CPU device per process, mesh data=2) trains the
    tiny config with a checkpoint per step; it is SIGKILLed (launcher and both processes) once
    step 2's checkpoint is complete, and the same command resumes it to step 4. Both processes
    write their part of every checkpoint (orbax: `state/ocdbt.process_<i>/` with data files
    and `state/array_metadatas/process_<i>`); only process 0 writes logs. The result equals
    one process with two virtual devices (the same global mesh data=2, the same programs)
    running 4 steps uninterrupted: the parameters and every metric but wall-clock ones are
    bitwise equal. Exact, not within a tolerance: both runs compile the same programs for
    the same 2-device mesh, every all-reduce sums two partials (a + b == b + a in floating
    point, whether gloo or one process adds them) and resumption is exact
    (`test_kill_after_step_2_and_resume_equals_uninterrupted`). Measured: equal."""

    config = tmp_path / "tiny_multihost.py"
    config.write_text(MULTIHOST_CONFIG)
    multi_dir, single_dir = tmp_path / "multi", tmp_path / "single"
    launch = ["bash", LAUNCHER, "2", "--", "--config", str(config), f"--config.run_dir={multi_dir}"]
    multi_env = {**_env(tmp_path / "cache"), "PYTHON": sys.executable}
    single_cmd = [sys.executable, "-m", "jaxgrpo.train", "--config", str(config)]
    procs = []
    try:
        single = _start(
            [*single_cmd, f"--config.run_dir={single_dir}"],
            _env(tmp_path / "cache", devices=2),
            tmp_path / "single.log",
        )
        victim = _start(launch, multi_env, tmp_path / "killed.log")
        procs += [single, victim]
        step2 = multi_dir / "checkpoints" / "2"  # orbax renames its tmp dir once all committed
        deadline = time.monotonic() + TIMEOUT_S
        while not (step2 / "commit_success.txt").exists():
            assert victim.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the two processes did not reach step 2"
            time.sleep(0.1)
        _kill_group(victim)
        assert victim.returncode == -signal.SIGKILL
        done = sorted(int(d) for d in os.listdir(multi_dir / "checkpoints") if d.isdigit())
        assert 4 not in done, f"killed too late to test resumption (checkpoints {done})"
        for i in range(2):
            shard = step2 / "state" / f"ocdbt.process_{i}"
            assert os.listdir(shard / "d"), f"process {i} wrote no checkpoint data"
            assert (shard / "manifest.ocdbt").exists()
            assert (step2 / "state" / "array_metadatas" / f"process_{i}").exists()
        assert len(_tb_scalars(multi_dir)) == 1, "one TensorBoard events file: process 0's"
        _assert_logs_written_once(multi_dir, 2)

        resumed = _start(launch, multi_env, tmp_path / "resumed.log")
        procs.append(resumed)
        log = _wait(resumed, tmp_path / "resumed.log")
        assert "resuming" in log
        single_log = _wait(single, tmp_path / "single.log")
    finally:
        for p in procs:
            _kill_group(p)
    for text in (log, single_log):
        assert "mesh data=2 fsdp=1 tensor=1" in text, "both runs must use the same global mesh"
    _assert_logs_written_once(multi_dir, 4)
    assert len(_tb_scalars(multi_dir)) == 2, "one events file per launch of process 0"
    for i in range(2):
        assert os.listdir(multi_dir / "checkpoints" / "4" / "state" / f"ocdbt.process_{i}" / "d")

    want, got = _metrics(single_dir), _metrics(multi_dir)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        got_s, want_s = _comparable(got[step]), _comparable(want[step])
        assert sorted(got_s) == sorted(want_s), step
        for key, value in want_s.items():
            if value is None:
                assert got_s[key] is None, (step, key)
            else:
                assert got_s[key] == value, (step, key, got_s[key], value)

    _assert_same_step_4(config, tmp_path, single_dir, multi_dir)


def _assert_same_step_4(config, tmp_path, want_dir, got_dir) -> None:
    """Both runs' step-4 checkpoints hold bitwise equal parameters and the same data cursor."""
    cfg = load_config(str(config), {"run_dir": str(tmp_path / "unused")})
    target = build_parts(cfg).learner.init_state()

    def final_params(run_dir):
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=1, keep=3)
        state, meta = ckpt.restore(target, 4)
        ckpt.close()
        return [np.asarray(x) for x in jax.tree.leaves(state.params)], meta

    (want_p, want_meta), (got_p, got_meta) = final_params(want_dir), final_params(got_dir)
    assert got_meta["data_cursor"] == want_meta["data_cursor"]
    assert max(np.abs(w).max() for w in want_p) > 0
    for g, w in zip(got_p, want_p, strict=True):
        np.testing.assert_array_equal(g, w)
