"""train.py: config resolution and errors at the CLI, the step loop's cursor, resume and stop."""

import json
import os
import signal
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.data import get_task
from jaxgrpo.models.config import LoRAConfig
from jaxgrpo.models.tiny import tiny_model_config, tiny_tokenizer
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.run import build, train
from jaxgrpo.run.runtime import RunFiles
from jaxgrpo.settings.loading import load_config


def _cli(args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxgrpo.train", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=120)


def test_cli_errors_name_the_problem_from_another_cwd(tmp_path):
    missing = _cli(["--config", "nope.py"], tmp_path)
    assert missing.returncode != 0
    assert "'nope.py' not found" in missing.stderr and "format_copy, " in missing.stderr
    # A bare shipped name resolves from any cwd; the run then fails validation, naming the key.
    bad = _cli(["--config", "tiny", "--config.rl.eps_low=-1.0"], tmp_path)
    assert bad.returncode != 0 and "config key 'rl.eps_low'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    typo = _cli(["--config=tiny.py", "--config.rl.betaa=0.1"], tmp_path)
    assert "unknown config key 'rl.betaa' (did you mean 'beta'?)" in typo.stderr, typo.stderr


def test_resolve_argv_paths_and_overrides(tmp_path, monkeypatch):
    local = tmp_path / "tiny.py"
    local.write_text(
        "from jaxgrpo.configs import tiny\n\ndef get_config():\n    return tiny.get_config()\n"
    )
    monkeypatch.chdir(tmp_path)
    # A path that exists is used as is, even when a shipped config has the same name.
    assert train.resolve_argv(["x", "--config", "tiny.py"]) == ["x", "--config", "tiny.py"]
    shipped = train.resolve_argv(["x", "--config=format_copy", "--config.rl.beta=0.1"])
    assert shipped[1].endswith(os.path.join("jaxgrpo", "configs", "format_copy.py"))
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        train.resolve_argv(["x", "--config", "tiny", "--config.optim.lrr=1"])
    with pytest.raises(ConfigError, match="--config is required"):
        train.resolve_argv(["x"])
    with pytest.raises(ConfigError, match="not found"):
        train.resolve_argv(["x", "--config", "sub/dir/tiny.py"])


class _ToyLearner:
    """Implements the Learner API with a 3-vector 'policy': enough to test the loop's bookkeeping.

    Each step adds the mean of the examples' integers plus RNG noise, so the final state depends on
    the exact examples seen, their order, and the RNG stream: a resume that skips or repeats data,
    or restores the key wrongly, changes it.
    """

    programs = types.SimpleNamespace(n_params=3, n_trainable=3)
    agent = None  # no tools

    def __init__(self, stop_at=None):
        self.seen, self.stop_at = [], stop_at
        self.mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])

    def init_state(self):
        return {"w": jnp.zeros(3, jnp.float32), "rng": jax.random.key(0), "n": jnp.int32(0)}

    def step(self, state, examples, draw=None):
        values = [int(e["answer"]) for e in examples]
        self.seen.extend(values)
        rng, sub = jax.random.split(state["rng"])
        w = state["w"] + np.float32(np.mean(values)) + jax.random.normal(sub, (3,))
        state = {"w": w, "rng": rng, "n": state["n"] + 1}
        if self.stop_at is not None and int(state["n"]) == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        metrics = {"reward/mean": float(w.sum()), "reward/std": 1.0, "time/update": 0.0}
        return state, metrics, [{"prompt": "p", "completion": str(v)} for v in values]

    def evaluate(self, state, examples):
        return {"strict_accuracy": float(len(examples)) + float(state["w"][0])}


def _cfg(run_dir, **overrides):
    base = {"run_dir": str(run_dir), "logging.tensorboard": False, "checkpoint.every": 2}
    return load_config("tiny", {**base, **overrides})


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    # Wall-clock entries differ between runs; everything else must match exactly.
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]


def test_resume_equals_uninterrupted_and_crosses_epochs(tmp_path):
    task = get_task("format_copy", num_train=5, num_eval=4)  # 2 prompts per step: epochs mix
    full = _ToyLearner()
    train.run(_cfg(tmp_path / "a", steps=5), build.RunParts(full, task))
    first, second = _ToyLearner(stop_at=3), _ToyLearner()  # interrupted (SIGTERM) at step 3
    train.run(_cfg(tmp_path / "b", steps=5), build.RunParts(first, task))
    final = train.run(_cfg(tmp_path / "b", steps=5), build.RunParts(second, task))
    assert first.seen + second.seen == full.seen, "the data cursor continues exactly"
    assert full.seen[:5] == [int(e["answer"]) for e in task.train_examples(0)]
    assert full.seen[5:10] == [int(e["answer"]) for e in task.train_examples(1)]
    rows_a, rows_b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert rows_a == rows_b, "metrics of the resumed run equal the uninterrupted run's"
    assert [r["step"] for r in rows_a] == [0, 1, 2, 3, 4, 5]
    assert "eval/strict_accuracy" in rows_a[0] and "eval/strict_accuracy" in rows_a[-1]
    assert final["reward/mean"] == rows_a[-1]["reward/mean"]
    assert os.path.exists(tmp_path / "a" / "samples.jsonl")
    with pytest.raises(ConfigError, match="config key 'resume'"):
        train.run(_cfg(tmp_path / "b", steps=6, resume=False), build.RunParts(_ToyLearner(), task))


def test_sigterm_finishes_the_step_and_checkpoints(tmp_path):
    task = get_task("format_copy", num_train=16, num_eval=4)
    learner = _ToyLearner(stop_at=3)
    cfg = _cfg(tmp_path, steps=10, **{"checkpoint.every": 0})
    train.run(cfg, build.RunParts(learner, task))
    assert len(learner.seen) == 3 * cfg.rl.prompts_per_step, "stopped right after step 3"
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=0, keep=1)
    state, meta = ckpt.restore(learner.init_state())
    assert ckpt.latest_step() == 3 and meta["data_cursor"] == 6 and int(state["n"]) == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "handlers restored"


def test_build_task_applies_the_task_section():
    task = build.build_task(load_config("tiny", {"task.system_prompt": "Be terse."}).task)
    examples = task.eval_examples()
    assert len(examples) == 4, "task.num_eval sizes format_copy's held-out set"
    assert examples[0]["messages"][0] == {"role": "system", "content": "Be terse."}
    with pytest.raises(ConfigError, match="config key 'task.prompt_template'"):
        build.build_task(load_config("tiny", {"task.prompt_template": "r1"}).task)
    with pytest.raises(ConfigError, match="config key 'task.name'.*known: .*format_copy"):
        load_config("tiny", {"task.name": "no_such_task"})  # validation knows the tasks


def test_perplexity_reward_gets_the_frozen_base_model():
    # The abstract model (shapes only): binding snapshots the state without running it.
    cfg = tiny_model_config(LoRAConfig(rank=4, alpha=8.0))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    tokenizer = tiny_tokenizer()
    specs = build.bind_model_rewards([("perplexity", 2.0), ("format_copy", 0.5)], model, tokenizer)
    assert specs[1] == ("format_copy", 0.5)
    assert callable(specs[0][0]) and specs[0][1] == 2.0
    # Scoring compiles the model (tens of seconds here); the reported name is what matters.
    assert RewardSet(specs).weights(0) == {"perplexity": 2.0, "format_copy": 0.5}


def test_run_files_for_remote_run_dirs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    remote = RunFiles("gs://bucket/runs/exp/", process=1)  # process 1 touches no storage
    assert remote.remote and remote.local_dir == os.path.join("runs", "exp")
    assert (
        RunFiles.join("gs://bucket/runs/exp/", "checkpoints") == "gs://bucket/runs/exp/checkpoints"
    )
    local = RunFiles(str(tmp_path / "run"), process=0)
    assert not local.remote and local.local_dir == str(tmp_path / "run")
    assert RunFiles.join(local.local_dir, "checkpoints") == str(tmp_path / "run" / "checkpoints")
    # The copy used for remote mirroring: all names, or only those missing at the target.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "metrics.jsonl").write_text("new")
    (tmp_path / "src" / "config.json").write_text("{}")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "metrics.jsonl").write_text("old")
    local._copy(str(tmp_path / "src"), str(tmp_path / "dst"), only_missing=True)
    assert (tmp_path / "dst" / "metrics.jsonl").read_text() == "old"
    assert (tmp_path / "dst" / "config.json").read_text() == "{}"
    local._copy(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "metrics.jsonl").read_text() == "new"


@pytest.mark.slow
def test_cli_reports_the_run_and_a_rerun_compiles_nothing(tmp_path, cli_env):
    """The header, held-out lines and summary a user sees; the second identical run reads every
    program from the persistent compilation cache instead of compiling it (on one CPU device:
    with several forced host devices the cache is off)."""
    env = {**cli_env, "JAX_LOG_COMPILES": "1", "JAXGRPO_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for name in ("first", "second"):
        args = ["--config", "tiny", f"--config.run_dir={tmp_path / name}", "--config.steps=2"]
        cmd = [sys.executable, "-m", "jaxgrpo.train", *args, "--config.eval.every=1"]
        runs.append(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300))
    first, second = runs
    assert first.returncode == 0, first.stderr[-2000:]
    out = first.stdout
    for text in (
        "model    tiny (random 2-layer test model): ",
        "LoRA rank 4",
        "task     format_copy: ",
        "devices  1 x cpu, mesh data=1 fsdp=1 tensor=1",
        f"cache    {tmp_path / 'cache'} (compiled programs, reused by later runs)",
        f"run dir  {tmp_path / 'first'} (new run)",
        "held-out before training: strict 0/4",
        "held-out at step 1: strict",
        "held-out at step 2: strict",
        "done: 2 steps in ",
        f"python -m jaxgrpo.export {tmp_path / 'first'} ",
        os.path.join(str(tmp_path / "first"), "plots", "dashboard.png"),
    ):
        assert text in out, f"{text!r} missing from the run's output:\n{out}"
    rows = _rows(tmp_path / "first")
    assert [r["step"] for r in rows] == [0, 1, 2] and all("eval/strict_accuracy" in r for r in rows)
    compiled = [r.stderr.count("Finished XLA compilation") for r in runs]
    hits = [r.stderr.count("Persistent compilation cache hit") for r in runs]
    assert compiled[0] > 10 and hits[0] == 0, (compiled, hits)
    assert hits[1] >= 0.9 * compiled[1], f"second run: {hits[1]} of {compiled[1]} cached"
    for name in ("prefill_fn", "decode_fn", "update"):  # the programs that take seconds
        made = second.stderr.count(f"Finished XLA compilation of jit({name})")
        read = second.stderr.count(f"Persistent compilation cache hit for 'jit_{name}'")
        assert made > 0 and read == made, f"{name}: {read} of {made} read from the cache"


def _kill_and_resume(tmp_path, env, args, fault):
    """Trains the tiny config with ``args`` (samples every step) into ``tmp_path / "full"``,
    then into ``tmp_path / "killed"``, SIGKILLed at ``JAXGRPO_FAULT=fault``, and again there
    to resume: (the killed run's metrics rows, the resumed run's process)."""

    def train(run_dir, **extra_env):
        cmd = [sys.executable, "-m", "jaxgrpo.train", "--config", "tiny"]
        cmd += [f"--config.run_dir={run_dir}", "--config.logging.samples_every=1", *args]
        return subprocess.run(
            cmd, capture_output=True, text=True, env={**env, **extra_env}, timeout=300
        )

    full = train(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = train(tmp_path / "killed", JAXGRPO_FAULT=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    killed_rows = _rows(tmp_path / "killed")
    resumed = train(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return killed_rows, resumed


@pytest.mark.slow
def test_a_run_killed_between_its_rows_and_its_checkpoint_logs_every_step_once(tmp_path, cli_env):
    """SIGKILL right after step 2's metrics and samples rows are written and before its
    checkpoint (fault injection): the resumed run rewrites step 2, so metrics.jsonl and
    samples.jsonl hold each step exactly once and equal an uninterrupted run's."""

    killed_rows, resumed = _kill_and_resume(
        tmp_path, cli_env, ["--config.checkpoint.every=1"], "logged:2"
    )
    assert [r["step"] for r in killed_rows] == [0, 1, 2], "killed in the window"
    assert "resuming at step 1" in resumed.stdout, resumed.stdout

    def rows(run_dir):  # wall-clock rates differ between any two runs
        return [{k: v for k, v in r.items() if not k.endswith("per_s")} for r in _rows(run_dir)]

    assert rows(tmp_path / "killed") == rows(tmp_path / "full")
    assert [r["step"] for r in rows(tmp_path / "full")] == [0, 1, 2, 3, 4]

    def samples(run_dir):
        with open(os.path.join(run_dir, "samples.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    assert samples(tmp_path / "killed") == samples(tmp_path / "full")


@pytest.mark.slow
def test_an_asynchronous_run_killed_mid_flight_resumes_exactly(tmp_path, cli_env):
    """Lag 1: SIGKILL after step 3's rows, with a batch in flight and the last checkpoint at
    step 2, which holds the weights batch 2 was sampled with (version 1). The resumed run
    samples it again with them, the same key and examples: its rows and samples equal an
    uninterrupted run's."""

    args = ["--config.checkpoint.every=2", "--config.rl.max_staleness=1", "--config.steps=5"]
    _, resumed = _kill_and_resume(tmp_path, cli_env, args, "logged:3")
    assert "resuming at step 2" in resumed.stdout, resumed.stdout

    def rows(run_dir):  # wall-clock times differ between any two runs
        timing = ("time/", "async/", "flops/tflops")
        return [
            {k: v for k, v in r.items() if not k.endswith("per_s") and not k.startswith(timing)}
            for r in _rows(run_dir)
        ]

    assert [r["step"] for r in rows(tmp_path / "full")] == [0, 1, 2, 3, 4, 5]
    assert rows(tmp_path / "killed") == rows(tmp_path / "full")
    assert [r["async/lag_max"] for r in _rows(tmp_path / "killed")[1:]] == [0, 1, 1, 1, 1]

    def samples(run_dir):
        with open(os.path.join(run_dir, "samples.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    assert samples(tmp_path / "killed") == samples(tmp_path / "full")


def test_task_arguments_from_the_command_line_and_bad_data_in_one_line(tmp_path):
    """--config.task.kwargs.<field> points a shipped config at local data; a field the task does
    not have, and a malformed data row, are each one line naming what is wrong."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"prompt": "Say {i}", "answer": "{i}"}}\n' for i in range(8)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Say 1", "answer": "1"}\n{"answer": "2"}\n')
    base = ["--config", "tiny", "--config.task.name=jsonl", "--config.steps=0"]
    typo = _cli([*base, "--config.task.kwargs.sourcee=x.jsonl"], tmp_path)
    assert typo.returncode != 0 and "config key 'task.kwargs.sourcee'" in typo.stderr
    assert "its options:" in typo.stderr and "Traceback" not in typo.stderr, typo.stderr
    broken = _cli(
        [*base, f"--config.run_dir={tmp_path / 'b'}", "--config.task.kwargs.source", str(bad)],
        tmp_path,
    )
    assert broken.returncode != 0 and "Traceback" not in broken.stderr, broken.stderr
    error = [line for line in broken.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and f"{bad}: row 2: missing field 'prompt'" in error[0], broken.stderr
    ok = _cli(
        [*base, f"--config.run_dir={tmp_path / 'g'}", f"--config.task.kwargs.source={good}"],
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    n = jax.device_count()  # forced host devices: the cache stays off and the header says why
    assert f"cache    off ({n} forced host devices: their collectives deadlock" in ok.stdout
    with open(tmp_path / "g" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["task"]["kwargs"] == {"source": str(good)}
