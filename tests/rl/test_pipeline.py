"""Asynchronous rollouts (`jaxgrpo.rl.pipeline`): the producer thread, the lag it keeps, the
weights it samples with, and what reaches the learner when it fails.

Each test trains the tiny model a few steps on one CPU device (the split-device test on 4 + 4
of the 8 virtual ones); the comparisons are bit for bit, since the producer runs the same
programs with the same keys and examples as the reference loop."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from learner_helpers import host_params, make_learner

from jaxgrpo.rewards import RewardSet
from jaxgrpo.rl.pipeline import RolloutPipeline
from jaxgrpo.run.runtime import DataStream

STEPS = 3


def _pipeline_run(learner, task, steps=STEPS):
    state = learner.init_state()
    pipeline = RolloutPipeline(learner, DataStream(task, learner.cfg.seed), state, 0, steps)
    history = []
    try:
        for _ in range(steps):
            state, metrics, _ = pipeline.train_step(state)
            history.append(metrics)
    finally:
        pipeline.close()
    return state, history


def _reference_run(learner, task, lag, steps=STEPS):
    """Step s samples with the weights after max(0, s - lag) updates and trains the current
    ones: the loop written out, one thing after the other."""
    p, b = learner.programs, learner.rl.prompts_per_step
    state = learner.init_state()
    keys, step, rng = [], state.step, state.rng
    for _ in range(steps):
        step, rng, key, _ = p.advance(step, rng)
        keys.append(key)
    data = DataStream(task, learner.cfg.seed)
    versions, history = {0: p.copy(state.params)}, []
    for s in range(steps):
        v = max(0, s - lag)
        batch = learner.collect_batch(versions[v], data.take(b), keys[s], s, data.take, v)
        next_step, next_rng, _, k_shuffle = p.advance(state.step, state.rng)
        state, metrics, _ = learner.train(state, batch, (next_step, next_rng, k_shuffle))
        versions[s + 1] = p.copy(state.params)
        history.append(metrics)
    return state, history


def _same_numbers(a: dict, b: dict) -> None:
    timing = ("time/", "flops/", "async/", "tokens_per_s")
    keys = [k for k in a if k in b and not k.startswith(timing)]
    assert len(keys) > 20
    for k in keys:
        assert a[k] == b[k] or (np.isnan(a[k]) and np.isnan(b[k])), (k, a[k], b[k])


def test_lag_0_through_the_pipeline_equals_the_synchronous_loop_bit_for_bit():
    learner, task = make_learner({"data": 1}, jax.devices()[:1])
    assert learner.rl.max_staleness == 0
    data = DataStream(task, learner.cfg.seed)
    state, sync = learner.init_state(), []
    for _ in range(STEPS):
        state, metrics, _ = learner.step(state, data.take(learner.rl.prompts_per_step), data.take)
        sync.append(metrics)
    piped_state, piped = _pipeline_run(learner, task)
    for a, b in zip(host_params(state), host_params(piped_state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(sync, piped, strict=True):
        _same_numbers(a, b)
    assert [m["async/lag_max"] for m in piped] == [0.0] * STEPS


@pytest.mark.parametrize("lag", [1, 2])
def test_a_lagging_run_samples_with_older_weights_and_trains_the_current_ones(lag):
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **{"rl.max_staleness": lag})
    state, piped = _pipeline_run(learner, task)
    ref_state, ref = _reference_run(learner, task, lag=lag)
    for a, b in zip(host_params(ref_state), host_params(state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ref, piped, strict=True):
        _same_numbers(a, b)
    assert [m["async/lag_mean"] for m in piped] == [float(min(s, lag)) for s in range(STEPS)]
    # The test can fail: sampling with the current weights trains to other numbers.
    lag0_state, _ = _reference_run(learner, task, lag=0)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(host_params(lag0_state), host_params(state), strict=True)
    ]
    assert any(changed)


def test_the_sampler_on_its_own_devices_holds_exactly_the_learners_weights_after_each_update():
    devices = jax.devices()
    learner, task = make_learner(
        {"data": 2}, devices[:2], sampler_devices=devices[4:8], **{"rl.max_staleness": 1}
    )
    side = learner.sampler_side
    assert side.own_devices and set(side.mesh.devices.flat) == set(devices[4:8])
    for leaf in jax.tree.leaves(side.frozen):
        assert leaf.sharding.device_set <= set(devices[4:8])
    state = learner.init_state()
    pipeline = RolloutPipeline(learner, DataStream(task, learner.cfg.seed), state, 0, STEPS)
    try:
        for step in range(1, STEPS + 1):
            state, metrics, _ = pipeline.train_step(state)
            held = pipeline.weights.wait(step)
            for mine, theirs in zip(
                jax.tree.leaves(held), jax.tree.leaves(state.params), strict=True
            ):
                assert mine.sharding.device_set <= set(devices[4:8])
                assert theirs.sharding.device_set <= set(devices[:2])
                np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
            assert metrics["time/weight_transfer"] >= 0 and np.isfinite(metrics["loss"])
    finally:
        pipeline.close()


def test_an_error_on_the_rollout_thread_reaches_the_learner_naming_the_step(monkeypatch):
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **{"rl.max_staleness": 1})
    collect = learner.collect_batch

    def failing(params, examples, key, step, *args, **kwargs):
        if step == 2:
            raise ValueError("data row 7: missing field 'prompt'")
        return collect(params, examples, key, step, *args, **kwargs)

    monkeypatch.setattr(learner, "collect_batch", failing)
    state = learner.init_state()
    pipeline = RolloutPipeline(learner, DataStream(task, learner.cfg.seed), state, 0, STEPS)
    try:
        state, _, _ = pipeline.train_step(state)
        state, _, _ = pipeline.train_step(state)
        with pytest.raises(ValueError, match="missing field") as raised:
            pipeline.train_step(state)
        assert "(raised on the rollout thread, sampling step 2)" in raised.value.__notes__
    finally:
        pipeline.close()


def test_a_hanging_reward_on_the_rollout_thread_is_stopped_at_its_time_limit():
    def hangs(prompts, completions, **_):
        while True:
            time.sleep(0.01)

    learner, task = make_learner({"data": 1}, jax.devices()[:1], **{"rl.max_staleness": 1})
    learner.reward_set = RewardSet([(hangs, 1.0)], timeout_s=0.5)
    t0 = time.perf_counter()
    _, history = _pipeline_run(learner, task, steps=2)
    assert time.perf_counter() - t0 < 60
    assert [m["reward/hangs/failed_frac"] for m in history] == [1.0, 1.0]


def test_dropping_stale_batches_keeps_every_trained_batch_within_the_lag():
    """ "drop": the producer samples with the newest weights it has and never waits for them;
    the learner drops what is more than max_staleness versions old (how many depends on
    timing, so only the bound is checked)."""
    overrides = {"rl.max_staleness": 1, "rl.stale_batches": "drop"}
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **overrides)
    state, history = _pipeline_run(learner, task, steps=4)
    assert all(m["async/lag_max"] <= 1 for m in history)
    assert all(np.isfinite(m["loss"]) for m in history)
    dropped = [m["async/dropped"] for m in history]
    assert dropped == sorted(dropped)  # a running count
