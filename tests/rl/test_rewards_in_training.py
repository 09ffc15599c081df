"""Rewards as the trainer calls them: TRL's keywords, length_penalty, failing functions.

Each test runs `Learner.step` on the random tiny model (tiny.py, 2 prompts x 4 samples, up to
8 new tokens), so what is checked is what a training run passes to reward functions.
"""

import dataclasses
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from learner_helpers import make_learner, run_steps, text_reward

from jaxgrpo.rewards import RewardError, get_reward
from jaxgrpo.rl.run_log import ProgressBar
from jaxgrpo.run.build import build_rewards

CALLS: list[dict] = []


def trl_conversational(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Written as for TRL's GRPOTrainer on a chat dataset; records what it was given."""
    CALLS.append(dict(prompts=prompts, completions=completions, ids=completion_ids, **kwargs))
    CALLS[-1]["step"] = trainer_state.global_step
    return [float(len(c[0]["content"])) for c in completions]


def always_raises(prompts, completions, **kwargs):
    raise KeyError("solution")


def every_other(prompts, completions, **kwargs):
    """Scores None for every second completion: fails on some samples of a step only."""
    return [None if i % 2 else float(len(c)) for i, c in enumerate(completions)]


def sleeps_forever(prompts, completions, **kwargs):
    time.sleep(1e9)


def spins(prompts, completions, **kwargs):
    """Pure Python that never returns and swallows ordinary exceptions."""
    n = 0
    while True:
        try:
            n += 1
        except Exception:
            pass


def allocates_without_end(prompts, completions, **kwargs):
    hoard = []
    while True:
        hoard.append(b"x" * (16 << 20))  # written, so resident


@pytest.fixture(scope="module")
def tiny():
    """One learner for the module (compiled once): 32 new tokens, and a row stops when a token
    repeats, so completions of one step have different lengths."""
    overrides = {"sampling.max_new_tokens": 32, "sampling.repetition_guard": (1, 2)}
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **overrides)
    return learner, list(task.train_examples(0)), learner.cfg


def learner_with(tiny, specs, **rewards_cfg):
    """The module's learner scoring with `specs` and `rewards.<key>` = value overrides, its
    reward set built from them as `jaxgrpo.run.build.build_rewards` builds a run's."""
    learner, examples, cfg = tiny
    rewards = dataclasses.replace(cfg.rewards, functions=tuple(specs), **rewards_cfg)
    learner.reward_set = build_rewards(rewards, None, None)
    learner.cfg = dataclasses.replace(cfg, rewards=rewards)
    return learner, examples


def test_length_penalty_scores_in_training(tiny):
    # Soft zone 2..32 tokens: r = (2 - L) / 30 for L in (2, 32], so sampled lengths give
    # distinct non-zero values (a row stops at its first repeated token, rarely within 2).
    penalty = get_reward("length_penalty", max_length=32, cache_length=30)
    learner, examples = learner_with(tiny, [(text_reward, 1.0), (penalty, 1.0)])
    state = learner.init_state()
    _, metrics, samples = learner.step(state, examples[:2])
    assert metrics["reward/length_penalty/failed_frac"] == 0.0, "every sample scored"
    mean = metrics["reward/length_penalty/mean"]
    assert np.isfinite(mean) and mean < 0.0, metrics
    lengths = np.array([s["length"] for s in samples])
    got = np.array([s["rewards"]["length_penalty"] for s in samples])
    np.testing.assert_allclose(got, np.clip((2.0 - lengths) / 30.0, -1.0, 0.0), atol=1e-6)
    assert len(set(lengths.tolist())) > 1 and len(set(got.tolist())) > 1, "varies with length"


def test_trl_conversational_reward_gets_messages_ids_and_step(tiny):
    CALLS.clear()
    learner, examples = learner_with(tiny, [(trl_conversational, 1.0)], conversational=True)
    _, history = run_steps(learner, examples, 2)
    assert [c["step"] for c in CALLS] == [0, 1]
    first = CALLS[0]
    assert first["prompts"][0] == examples[0]["messages"], "prompts are the chat messages"
    assert len(first["prompts"]) == len(first["completions"]) == 8
    assert all(c[0]["role"] == "assistant" for c in first["completions"])
    assert all(isinstance(ids, list) and 0 < len(ids) <= 32 for ids in first["ids"])
    assert [len(ids) for ids in first["ids"]] == first["completion_lengths"]
    assert first["answer"][:4] == [examples[0]["answer"]] * 4, "columns, G per prompt"
    assert history[1]["reward/trl_conversational/failed_frac"] == 0.0


def test_reward_failing_every_sample_stops_after_max_failed_steps(tiny):
    learner, examples = learner_with(
        tiny, [(always_raises, 1.0), (text_reward, 1.0)], max_failed_steps=2
    )
    state = learner.init_state()
    state, metrics, _ = learner.step(state, examples[:2])
    assert metrics["reward/always_raises/failed_frac"] == 1.0
    with pytest.raises(RewardError) as info:
        learner.step(state, examples[2:4])
    message = str(info.value)
    assert "'always_raises'" in message and "2 consecutive steps" in message
    assert "KeyError('solution')" in message and "completion" in message


def test_reward_failing_some_samples_keeps_training(tiny):
    learner, examples = learner_with(
        tiny, [(every_other, 1.0), (text_reward, 1.0)], max_failed_steps=1
    )
    _, history = run_steps(learner, examples, 3)
    assert [m["reward/every_other/failed_frac"] for m in history] == [0.5] * 3


@pytest.mark.parametrize("bad", [sleeps_forever, spins, allocates_without_end])
def test_reward_past_its_limits_scores_none_and_the_run_goes_on(tiny, bad):
    """A call past `rewards.timeout_s` (or, allocating, past `rewards.max_memory_gb`) is
    stopped: its samples score None (failed_frac 1), the other reward still scores, the step
    finishes within a few seconds of the limit, and the next step runs the function again."""
    learner, examples = learner_with(
        tiny, [(bad, 1.0), (text_reward, 1.0)], timeout_s=2.0, max_memory_gb=0.5
    )
    t0 = time.perf_counter()
    _, history = run_steps(learner, examples, 2)
    took = time.perf_counter() - t0
    name = bad.__name__
    assert [m[f"reward/{name}/failed_frac"] for m in history] == [1.0, 1.0]
    assert all(m["reward/text_reward/failed_frac"] == 0.0 for m in history)
    assert all(np.isfinite(m["reward/mean"]) for m in history)
    assert learner.reward_set.error_counts[name] == 16, "8 samples in each of 2 steps"
    limit = 2 * (2.0 + 1.5) + 60  # two limited calls, the watchdog's latency, the steps
    assert took < limit, f"{took:.1f} s: the limit did not stop the call"


def test_cli_reports_a_failing_reward_in_one_line(tmp_path, cli_env):
    (tmp_path / "bad_rewards.py").write_text(
        "def always_raises(prompts, completions, **kwargs):\n    raise KeyError('solution')\n"
    )
    (tmp_path / "cfg.py").write_text(
        textwrap.dedent(
            f"""
            from jaxgrpo.configs import tiny

            def get_config():
                c = tiny.get_config()
                c.run_dir = {str(tmp_path / "run")!r}
                c.rewards.functions = (("bad_rewards.always_raises", 1.0),)
                c.rewards.max_failed_steps = 2
                return c
            """
        )
    )
    env = {**cli_env, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "jaxgrpo.train", "--config", str(tmp_path / "cfg.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    line = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "'bad_rewards.always_raises'" in line[0], out.stderr
    assert "2 consecutive steps" in line[0] and "KeyError('solution')" in line[0]


def test_progress_bar_shows_failed_fraction_when_non_zero():
    text = ProgressBar.describe(
        {"reward/mean": 0.5, "reward/f/failed_frac": 0.25, "reward/g/failed_frac": 0.0}
    )
    assert "f failed=0.25" in text and "g failed" not in text, text
