"""One reward call everywhere: a reward written for TRL's GRPOTrainer, which asserts every
argument it is given, runs in the training steps, the held-out evaluation during training,
``python -m jaxgrpo.evaluate`` and a study's evaluation, and gets the same arguments in each."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxgrpo.core.sharding import make_mesh
from jaxgrpo.rl.learner import Learner
from jaxgrpo.run import study_results
from jaxgrpo.run.build import build_rewards, build_task, load_policy
from jaxgrpo.settings.loading import load_config
from jaxgrpo.settings.schema import resolve_mesh_shape

# Written as a TRL user writes a reward: positional TRL arguments, the rest in **kwargs. It
# raises (AssertionError) on any argument it does not expect, and the configs below use
# rewards.reward_on_error="raise", so a missing or malformed argument stops the run.
REWARD = """
import dataclasses
import json
import os


def token_count_reward(prompts, completions, completion_ids, trainer_state, **kwargs):
    n = len(completions)
    assert len(prompts) == n and all(isinstance(p, str) and p for p in prompts), prompts
    assert all(isinstance(c, str) for c in completions), completions
    assert len(completion_ids) == n, completion_ids
    assert all(isinstance(t, int) for ids in completion_ids for t in ids), completion_ids
    assert kwargs["completion_lengths"] == [len(ids) for ids in completion_ids], kwargs
    assert len(kwargs["answer"]) == n and all(kwargs["answer"]), kwargs["answer"]
    assert callable(kwargs["log_metric"]) and callable(kwargs["log_extra"])
    assert trainer_state.max_steps == 2, trainer_state
    assert 0 <= trainer_state.global_step <= 2, trainer_state
    kwargs["log_metric"]("mean_ids", sum(map(len, completion_ids)) / n)
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"n": n, "step": trainer_state.global_step}) + "\\n")
    return [float(len(ids)) for ids in completion_ids]
"""

CONFIG = """
from jaxgrpo.configs import tiny


def get_config():
    c = tiny.get_config()
    c.run_dir = {run_dir!r}
    c.steps = 2
    c.checkpoint.every = 1
    c.rewards.functions = (("trl_style_rewards.token_count_reward", 1.0), ("format_copy", 1.0))
    c.rewards.reward_on_error = "raise"
    c.eval.num_samples = 2
    c.eval.max_new_tokens = 8
    return c
"""


def _calls(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run scored by the TRL-style reward (4 held-out prompts, 2 x 4 samples a
    step), trained by the CLI; returns (tmp dir, run dir, config path, reward log, env)."""
    tmp = tmp_path_factory.mktemp("trl_reward")
    (tmp / "trl_style_rewards.py").write_text(REWARD)
    run_dir = str(tmp / "run")
    (tmp / "cfg.py").write_text(CONFIG.format(run_dir=run_dir))
    log = tmp / "calls.jsonl"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags),
        "PYTHONPATH": str(tmp),
        "REWARD_LOG": str(log),
    }
    cmd = [sys.executable, "-m", "jaxgrpo.train", "--config", str(tmp / "cfg.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, run_dir, str(tmp / "cfg.py"), log, env


def test_training_and_held_out_evaluation_call_it_alike(trained):
    _, run_dir, _, log, _ = trained
    calls = _calls(log)
    # Held out before training (4 prompts, step 0), the two steps (8 samples each), held out
    # after training at step 2.
    assert calls == [
        {"n": 4, "step": 0},
        {"n": 8, "step": 0},
        {"n": 8, "step": 1},
        {"n": 4, "step": 2},
    ], calls
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    held_out = [r for r in rows if "eval/reward/trl_style_rewards.token_count_reward/mean" in r]
    assert len(held_out) == 2 and all(
        r["eval/reward/trl_style_rewards.token_count_reward/failed_frac"] == 0.0 for r in held_out
    )


def test_evaluate_cli_scores_with_the_runs_rewards(trained):
    tmp, run_dir, _, log, env = trained
    before = len(_calls(log))
    out_path = tmp / "eval.json"
    cmd = [
        sys.executable,
        "-m",
        "jaxgrpo.evaluate",
        "--checkpoint",
        run_dir,
        "--max_examples",
        "4",
        "--out",
        str(out_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _calls(log)[before:] == [{"n": 8, "step": 2}], "4 prompts x 2 samples, at step 2"
    result = json.loads(out_path.read_text())["runs"]["run"]["tasks"]["format_copy"]
    summary, records = result["summary"], result["records"]
    lengths = np.array([r["length"] for r in records], np.float64)
    rewards = np.array(
        [r["rewards"]["trl_style_rewards.token_count_reward"] for r in records], np.float64
    )
    np.testing.assert_array_equal(rewards, lengths)  # the reward counts the completion's ids
    assert summary["reward/trl_style_rewards.token_count_reward/mean"] == pytest.approx(
        lengths.mean()
    )
    assert summary["reward/trl_style_rewards.token_count_reward/failed_frac"] == 0.0


def test_study_evaluation_calls_it_alike(trained, monkeypatch):
    tmp, run_dir, cfg_path, log, env = trained
    monkeypatch.setenv("REWARD_LOG", env["REWARD_LOG"])
    monkeypatch.syspath_prepend(str(tmp))
    cfg = load_config(cfg_path, {"run_dir": run_dir})
    before = len(_calls(log))
    result = study_results.Evaluator(cfg)("arm", cfg, run_dir, str(tmp / "study_eval"))
    assert _calls(log)[before:] == [{"n": 8, "step": 2}], "4 held-out prompts x 2 samples"
    assert result["summary"]["reward/trl_style_rewards.token_count_reward/failed_frac"] == 0.0


def test_reward_of_a_trl_conversational_function_in_held_out_evaluation(trained, monkeypatch):
    """With rewards.conversational, held-out evaluation gives a user function TRL's messages,
    as training does (tests/rl/test_rewards_in_training.py checks training)."""
    tmp, run_dir, cfg_path, _, _ = trained
    seen = []

    def conversational(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.append((prompts, completions, trainer_state.global_step))
        return [1.0] * len(completions)

    cfg = load_config(cfg_path, {"run_dir": run_dir})
    mesh = make_mesh(resolve_mesh_shape(cfg, 1), jax.devices()[:1])
    model, tokenizer, _ = load_policy(cfg, None, mesh)
    specs = ((conversational, 1.0),)
    rewards_cfg = dataclasses.replace(cfg.rewards, functions=specs, conversational=True)
    task = build_task(cfg.task)
    learner = Learner(
        cfg, model, tokenizer, task, build_rewards(rewards_cfg, model, tokenizer), mesh
    )
    examples = list(task.eval_examples())
    learner.evaluate(learner.init_state(), examples)
    ((prompts, completions, step),) = seen
    assert prompts == [ex["messages"] for ex in examples]
    assert all(c[0]["role"] == "assistant" for c in completions) and step == 0
