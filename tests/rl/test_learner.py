"""The GRPO step end to end on the tiny model: sharding invariance, compilation, accumulation.

Every learner here trains the random tiny model ("tiny" source) on format_copy prompts with a
reward that depends on the sampled text (a random model never earns format_copy credit, and a
constant reward would give zero advantages and a trivially equal update).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_helpers import count_compiles, host_params, make_learner, run_steps, text_reward

from jaxgrpo.core import sharding
from jaxgrpo.core.sharding import to_host
from jaxgrpo.data import get_task
from jaxgrpo.models.layout import Layout
from jaxgrpo.models.lora import zero_lora
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl import step_metrics
from jaxgrpo.rl.objective import make_loss_fn
from jaxgrpo.rl.programs import StepPrograms
from jaxgrpo.settings.loading import load_config

PARAM_ATOL = 1e-5  # float32; 8 devices reduce the same sums in a different order


@pytest.fixture(scope="module")
def one_device_run():
    """Two steps on one device, with grad accumulation over the two groups."""
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **{"rl.grad_accum": 2})
    examples = list(task.train_examples(0))[:4]
    state = learner.init_state()
    state, m1, samples = learner.step(state, examples[:2])
    p1 = host_params(state)
    with count_compiles() as compiles:
        state, m2, _ = learner.step(state, examples[2:4])
    return {
        "examples": examples,
        "params": [p1, host_params(state)],
        "metrics": [m1, m2],
        "samples": samples,
        "compiles_step2": len(compiles),
        "learner": learner,
    }


def test_step_metrics_and_samples(one_device_run):
    m = one_device_run["metrics"][0]
    for key in (
        "reward/mean",
        "reward/std",
        "kl/mean",
        "entropy",
        "clip_frac",
        "ratio_mean",
        "adv/frac_zero_std_groups",
        "completion/length_mean",
        "completion/truncated_frac",
        "strict_accuracy",
        "lenient_accuracy",
        "format_rate",
        "time/sampling",
        "time/rewards",
        "time/reference",
        "time/update",
        "tokens_per_s",
        "sampler_logp_gap",
        "grad_norm",
    ):
        assert key in m and np.isfinite(m[key]), key
    assert m["reward/std"] > 0, "the test reward must vary, or nothing is trained"
    assert m["grad_norm"] > 0
    # On-policy single update: the ratio is exactly 1 and the KL at step 0 is 0 (B = 0).
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(m["kl/mean"]) < 1e-6
    # The sampler's and the trainer's log-probs agree in float32 (prefix-shared scoring).
    assert m["sampler_logp_gap"] < 1e-4
    samples = one_device_run["samples"]
    assert len(samples) == 2 * 4 and {"prompt", "completion", "reward", "advantage"} <= set(
        samples[0]
    )


def test_params_move_and_second_step_compiles_nothing(one_device_run):
    p1, p2 = one_device_run["params"]
    assert max(np.abs(a - b).max() for a, b in zip(p1, p2, strict=True)) > 0
    assert one_device_run["compiles_step2"] == 0, (
        f"step 2 compiled {one_device_run['compiles_step2']} programs; every program "
        "(prefill, decode, logprobs, update) must be compiled by step 1"
    )


def test_eight_devices_2x2x2_equal_one_device(one_device_run):
    devices = jax.devices()
    assert len(devices) == 8, "conftest sets 8 virtual CPU devices"
    learner, _ = make_learner({"data": 2, "fsdp": 2, "tensor": 2}, devices, **{"rl.grad_accum": 2})
    state = learner.init_state()
    state, metrics, _ = learner.step(state, one_device_run["examples"][:2])
    for got, want in zip(host_params(state), one_device_run["params"][0], strict=True):
        np.testing.assert_allclose(got, want, atol=PARAM_ATOL)
    want_m = one_device_run["metrics"][0]
    for key in ("reward/mean", "loss", "grad_norm", "entropy"):
        assert metrics[key] == pytest.approx(want_m[key], rel=1e-4, abs=1e-6), key


def test_evaluate_reports_accuracy(one_device_run):
    learner = one_device_run["learner"]
    state = learner.init_state()
    m = learner.evaluate(state, one_device_run["examples"][:3])
    assert m["num_examples"] == 3
    for key in ("strict_accuracy", "lenient_accuracy", "format_rate"):
        assert 0.0 <= m[key] <= 1.0, key


def _rollout(rewards_BG, prompt_len):
    """A host-side rollout with given rewards (no model involved)."""
    b, g = rewards_BG.shape
    n, t = b * g, 3
    return ro.Rollout(
        examples=[{"messages": [], "answer": str(i)} for i in range(b)],
        prompt_ids=np.arange(b * prompt_len, dtype=np.int32).reshape(b, prompt_len) + 1,
        prompt_mask=np.ones((b, prompt_len), np.int32),
        tokens=np.arange(n * t, dtype=np.int32).reshape(n, t),
        mask=np.ones((n, t), np.int32),
        logprobs=np.zeros((n, t), np.float32),
        temps=np.ones((n, t), np.float32),
        stop_reason=np.zeros(n, np.int32),
        lengths=np.full(n, t, np.int32),
        prompts=[f"p{i // g}" for i in range(n)],
        completions=[f"c{i}" for i in range(n)],
        rewards=rewards_BG.reshape(-1).astype(np.float32),
        per_fn={"r": rewards_BG.reshape(-1).astype(np.float32)},
        weights={"r": 1.0},
        correct=None,
    )


def test_rollout_group_selection_and_concat_keep_groups_aligned():
    first = _rollout(np.array([[1.0, 1.0], [0.0, 1.0]]), prompt_len=4)
    second = _rollout(np.array([[0.5, 0.5], [2.0, 0.0]]), prompt_len=8)
    np.testing.assert_array_equal(first.zero_variance_groups(), [True, False])
    merged = ro.concat([first, second], pad_id=0)
    assert merged.prompt_ids.shape == (4, 8)
    # The shorter prompts are left-padded, their tokens unchanged at the right.
    np.testing.assert_array_equal(merged.prompt_ids[0, 4:], first.prompt_ids[0])
    np.testing.assert_array_equal(merged.prompt_mask[0], [0] * 4 + [1] * 4)
    kept = merged.select_groups(np.flatnonzero(~merged.zero_variance_groups()))
    assert [ex["answer"] for ex in kept.examples] == ["1", "1"]
    np.testing.assert_array_equal(kept.rewards, [0.0, 1.0, 2.0, 0.0])
    assert kept.completions == ["c2", "c3", "c2", "c3"]
    np.testing.assert_array_equal(kept.tokens[2], second.tokens[2])


def parity_reward(prompts, completions, answer, **_):
    """text_reward for odd answers, 0 for even ones: even groups have no reward variance."""
    scores = text_reward(prompts, completions)
    return [r if int(a) % 2 else 0.0 for r, a in zip(scores, answer, strict=True)]


def test_off_policy_options_step():
    """ppo_epochs x minibatches with old log-probs, KL in reward, TIS, reference reset and
    dynamic sampling with refills all run, and report what they did."""
    learner, task = make_learner(
        {"data": 1},
        jax.devices()[:1],
        reward=parity_reward,
        **{
            "rl.ppo_epochs": 2,
            "rl.num_minibatches": 2,
            "rl.kl_in_reward": True,
            "rl.tis_cap": 2.0,
            "rl.ref_reset_every": 1,
            "rl.ref_reset_optimizer": True,
            "rl.dynamic_sampling": True,
            "rl.dynamic_sampling_max_draws": 3,
        },
    )
    assert learner.programs.old_from == "forward", "TIS needs the trainer's behaviour log-probs"
    stream = iter(task.train_examples(0))
    drawn = []

    def draw(n):
        drawn.append(n)
        return [next(stream) for _ in range(n)]

    state = learner.init_state()
    for _ in range(2):
        drawn.clear()
        state, m, samples = learner.step(state, draw(2), draw=draw)
        assert m["updates"] == 4  # 2 epochs x 2 minibatches
        assert np.isfinite(m["loss"]) and m["update_skipped"] == 0
        assert "kl/in_reward_mean" in m
        assert m["draws"] == len(drawn), "each sampling round draws one batch of prompts"
        odd = [int(s["prompt"].rsplit(": ", 1)[1].split("<")[0]) % 2 for s in samples]
        if m["draws"] < 3:  # refilled: every kept group has reward variance
            assert all(odd), "a zero-variance group was kept although refills remained"
    # After the first update of a step the policy has moved: ratios leave 1.
    assert m["ratio_max"] > 1.0 or m["ratio_min"] < 1.0
    # The reference was reset to the policy at step 1: its LoRA B is no longer zero.
    ref, zeroed = jax.tree.leaves(state.ref_params), jax.tree.leaves(zero_lora(state.ref_params))
    diffs = [float(np.abs(to_host(a) - to_host(b)).max()) for a, b in zip(ref, zeroed, strict=True)]
    assert max(diffs) > 0


def test_trimmed_and_packed_scoring_change_nothing(monkeypatch):
    """Without packing the update trims the completions to their longest row's power-of-two
    bucket; with packing each group's completions share one row. The parameters after one
    update equal those of the untrimmed, unpacked batch (dr_grpo still divides by
    max_new_tokens, not by the trimmed width)."""

    t_max = 16
    learner, _ = make_learner(
        {"data": 1},
        jax.devices()[:1],
        **{
            "rl.loss_type": "dr_grpo",
            "sampling.max_new_tokens": t_max,
            "rl.pack_completions": False,
        },
    )
    b, g = learner.rl.prompts_per_step, learner.rl.group_size
    rng = np.random.default_rng(0)
    rollout = _rollout(rng.normal(size=(b, g)), prompt_len=8)
    lengths = rng.integers(1, 7, b * g).astype(np.int32)  # every row ends by column 6
    cols = np.arange(t_max)[None, :]
    mask = (cols < lengths[:, None]).astype(np.int32)
    rollout.tokens = rng.integers(3, 200, (b * g, t_max)).astype(np.int32) * mask
    rollout.mask, rollout.lengths = mask, lengths
    rollout.logprobs = np.zeros((b * g, t_max), np.float32)
    rollout.temps = np.ones((b * g, t_max), np.float32)
    rollout.stop_reason = np.ones(b * g, np.int32)

    def one_update(state):
        batch, _ = learner.prepare(state, rollout)
        k_shuffle = learner.programs.advance(state.step, state.rng)[3]
        state, _ = learner.optimize(state, batch, k_shuffle)
        return batch.tokens.shape[1], host_params(state)

    state0 = learner.init_state()
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731  (the update donates its state)
    width, trimmed = one_update(copy(state0))
    monkeypatch.setattr(ro, "completion_bucket", lambda lengths, t, buckets=None: t)
    full_width, full = one_update(copy(state0))
    learner.rl = learner.programs.rl = dataclasses.replace(learner.rl, pack_completions=True)
    learner.programs.build()
    packed_width, packed = one_update(copy(state0))
    assert (width, full_width, packed_width) == (8, t_max, t_max)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(full, host_params(state0), strict=True))
    assert moved > 1e-4, "the update must move the parameters for the comparison to mean much"
    for a, b, c in zip(trimmed, full, packed, strict=True):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL)
        np.testing.assert_allclose(c, b, atol=PARAM_ATOL)


def test_sharing_the_prompts_common_prefix_changes_nothing():
    """With prompts that begin alike (a system prompt), the scoring passes run those tokens
    once for the batch; the reference log-probs and the parameters after one update equal
    those of scoring every prompt whole."""

    learner, _ = make_learner({"data": 1}, jax.devices()[:1])
    b, g = learner.rl.prompts_per_step, learner.rl.group_size
    rng = np.random.default_rng(3)
    rollout = _rollout(rng.normal(size=(b, g)), prompt_len=40)
    system = rng.integers(3, 200, 27)
    for i in range(b):  # 27 common tokens, then 2 to 5 of each prompt's own, left-padded
        own = rng.integers(3, 200, 2 + i % 4)
        row = np.concatenate([system, own])
        rollout.prompt_ids[i], rollout.prompt_mask[i] = 0, 0
        rollout.prompt_ids[i, -len(row) :], rollout.prompt_mask[i, -len(row) :] = row, 1

    def one_update(state):
        batch, _ = learner.prepare(state, rollout)
        k_shuffle = learner.programs.advance(state.step, state.rng)[3]
        state, _ = learner.optimize(state, batch, k_shuffle)
        return batch.shared_ids.shape, to_host(batch.ref_logp), host_params(state)

    state0 = learner.init_state()
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731  (the update donates its state)
    shared_shape, shared_ref, shared = one_update(copy(state0))
    learner.rl = dataclasses.replace(learner.rl, share_prompt_prefix=False)
    whole_shape, whole_ref, whole = one_update(copy(state0))
    assert (shared_shape, whole_shape) == ((1, 24), (1, 0))
    np.testing.assert_allclose(shared_ref, whole_ref, atol=1e-5)
    moved = max(float(np.abs(a - c).max()) for a, c in zip(whole, host_params(state0), strict=True))
    assert moved > 1e-4, "the update must move the parameters for the comparison to mean much"
    for a, c in zip(shared, whole, strict=True):
        np.testing.assert_allclose(a, c, atol=PARAM_ATOL)


def test_prompt_trimming_keeps_every_prompt_token():
    ids = np.zeros((2, 128), np.int32)
    mask = np.zeros((2, 128), np.int32)
    mask[0, -87:], mask[1, -40:] = 1, 1
    ids[mask > 0] = 7
    short_ids, short_mask = ro.trim_prompts(ids, mask)
    assert short_ids.shape == (2, 96)
    assert short_mask.sum() == mask.sum() and (short_ids[short_mask > 0] == 7).all()
    assert ro.trim_prompts(ids[1:, -64:], mask[1:, -64:])[0].shape == (1, 48)
    assert ro.completion_bucket(np.array([3, 9, 1]), 32) == 16
    assert ro.completion_bucket(np.array([3, 32, 1]), 32) == 32
    assert ro.completion_bucket(np.array([2, 1]), 32) == 8


def test_batch_widths_only_grow_so_programs_compile_a_bounded_number_of_times():
    """Long prompts, short prompts, then both again: once the run's widths have settled (the
    prompt and suffix widths at their largest, the shared prefix at its shortest), no step
    compiles a new program, although each step's own widths differ."""
    buckets = ro.ShapeBuckets()
    ids = np.full((2, 128), 7, np.int32)
    mask = np.zeros((2, 128), np.int32)
    mask[:, -87:] = 1
    assert ro.trim_prompts(ids, mask, buckets)[0].shape == (2, 96)
    short = ro.trim_prompts(ids[:, -64:], mask[:, -64:] * (np.arange(64) >= 24), buckets)
    assert short[0].shape == (2, 96) and short[1].sum() == 2 * 40, "padded up, tokens kept"
    assert buckets.shrink("shared", 72) == 72 and buckets.shrink("shared", 40) == 40
    assert buckets.shrink("shared", 72) == 40

    learner, _ = make_learner({"data": 1}, jax.devices()[:1])
    long_task = get_task("format_copy", worked_example=True)
    short_task = get_task("format_copy", worked_example=False)
    batches = [list(t.train_examples(0))[:2] for t in (long_task, short_task)]
    state = learner.init_state()
    for examples in batches:
        state, _, _ = learner.step(state, examples)
    with count_compiles() as compiles:
        for examples in batches:
            state, _, _ = learner.step(state, examples)
    assert len(compiles) == 0, f"{len(compiles)} programs compiled after the widths settled"


@pytest.mark.slow  # 60 s alone, 110 s on a busy 2-core CPU: two learners compile
def test_full_fine_tuning_step_trains_every_weight_against_a_frozen_reference():
    """`model.lora_rank=0` through `Learner.step`: every parameter is trainable and moves, the
    KL reference (rl.beta > 0) is the initial weights (no copy in the state), not the trained ones,
    and one step on 8 devices (data=2, fsdp=2, tensor=2) equals the step on one device."""
    # Adam's epsilon at 1e-6 instead of 1e-8: see the untouched rows below.
    full = {"model.lora_rank": 0, "rl.beta": 0.04, "optim.eps": 1e-6}
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **full)
    assert not learner.programs.lora and learner.programs.needs_ref
    assert learner.programs.n_trainable == learner.programs.n_params, (
        "full fine-tuning trains every weight"
    )
    examples = list(task.train_examples(0))[:2]
    state = learner.init_state()
    p0 = host_params(state)
    state, metrics, _ = learner.step(state, examples)
    assert metrics["reward/std"] > 0 and metrics["grad_norm"] > 0
    p1 = host_params(state)
    assert state.ref_params is None, "full fine-tuning without resets keeps no reference copy"
    ref = [to_host(x) for x in jax.tree.leaves(learner.programs.reference(state))]
    assert len(p1) == len(p0) == len(ref)
    moved = [float(np.abs(a - b).max()) for a, b in zip(p1, p0, strict=True)]
    assert min(moved) > 0, f"every weight must move under full fine-tuning; max |delta|: {moved}"
    for r, a in zip(ref, p0, strict=True):
        np.testing.assert_array_equal(r, a, err_msg="the reference must stay the initial weights")
    assert max(float(np.abs(r - a).max()) for r, a in zip(ref, p1, strict=True)) > 1e-4

    devices = jax.devices()
    assert len(devices) == 8, "conftest sets 8 virtual CPU devices"
    learner8, _ = make_learner({"data": 2, "fsdp": 2, "tensor": 2}, devices, **full)
    state8 = learner8.init_state()
    state8, metrics8, _ = learner8.step(state8, examples)
    # Adam's first step moves a weight by lr * g / (|g| + eps): the embedding rows of tokens
    # absent from the batch have g = 0 exactly on one device and float noise (~1e-9) on 8. With
    # eps = 1e-8 that noise became a step of up to 8% of lr (seen in CI); with eps = 1e-6 noise
    # below 5e-8 stays under 5% of lr, while real gradients (>= 1e-4 here) still step by ~lr.
    noise_step = 0.05 * learner.cfg.optim.lr
    for got, want, init in zip(host_params(state8), p1, p0, strict=True):
        untouched = want == init
        np.testing.assert_allclose(got[~untouched], want[~untouched], atol=PARAM_ATOL)
        assert np.abs(got - want)[untouched].max(initial=0.0) < noise_step
    for got, want in zip(jax.tree.leaves(learner8.programs.reference(state8)), p0, strict=True):
        np.testing.assert_array_equal(to_host(got), want)
    for key in ("reward/mean", "loss", "grad_norm", "entropy"):
        assert metrics8[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


def test_full_fine_tuning_reference_reset_keeps_its_copy_in_the_state():
    """Without resets full fine-tuning's reference is the learner's initial weights (no copy
    in the state); with `rl.ref_reset_every` the state holds the copy, and a reset at step 1
    makes it the policy as step 0 left it."""
    full = {"model.lora_rank": 0, "rl.beta": 0.04, "rl.ref_reset_every": 1}
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **full)
    assert learner.programs.ref_in_state
    examples = list(task.train_examples(0))[:2]
    state = learner.init_state()
    p0 = host_params(state)
    for got, want in zip(jax.tree.leaves(learner.programs.reference(state)), p0, strict=True):
        np.testing.assert_array_equal(to_host(got), want)
    state, _, _ = learner.step(state, examples)
    p1 = host_params(state)
    state, _, _ = learner.step(state, examples)  # resets the reference first
    ref = [to_host(x) for x in jax.tree.leaves(learner.programs.reference(state))]
    for got, want in zip(ref, p1, strict=True):
        np.testing.assert_array_equal(got, want)
    assert max(float(np.abs(r - a).max()) for r, a in zip(ref, p0, strict=True)) > 0


def test_wide_rows_split_the_update_into_micro_batches_with_the_same_weights():
    """`rl.micro_batch_columns` below one packed row splits the two-group update in two
    micro-batches; the trained weights equal the unsplit update's (every micro-batch is
    normalised by the whole minibatch), and the step reports the split."""
    trained = {}
    for columns in (0, 1):
        learner, task = make_learner(
            {"data": 1}, jax.devices()[:1], **{"rl.micro_batch_columns": columns}
        )
        state, history = run_steps(learner, list(task.train_examples(0))[:2], 1)
        trained[columns] = host_params(state), history[0]
    assert trained[0][1]["micro_batches"] == 1 and trained[1][1]["micro_batches"] == 2
    for key in ("loss", "grad_norm", "kl/mean"):
        assert trained[1][1][key] == pytest.approx(trained[0][1][key], rel=1e-5, abs=1e-7), key
    for got, want in zip(trained[1][0], trained[0][0], strict=True):
        np.testing.assert_allclose(got, want, atol=PARAM_ATOL)


@pytest.mark.parametrize(
    ("overrides", "width", "want"),
    [
        ({"rl.micro_batch_columns": 0}, 3100, 1),  # off: rl.grad_accum
        ({}, 3100, 4),  # auto on CPU (4096): 4 rows per device are 12,400 columns, 1 is 3,100
        ({}, 1100, 2),  # 4 rows of 1,100 are 4,400 columns, 2 are 2,200
        ({}, 1000, 1),  # 4 rows of 1,000 fit
        ({"rl.micro_batch_columns": 1}, 3100, 4),  # 8 micro-batches would not split over 4
        ({"rl.micro_batch_columns": 1, "rl.grad_accum": 2}, 100, 4),
        # unpacked: 32 rows of 700 per device are 22,400 columns, 16 are 11,200
        ({"rl.micro_batch_columns": 20000, "rl.pack_completions": False}, 700, 2),
        ({"rl.micro_batch_columns": 1, "rl.pack_completions": False}, 700, 16),  # 2 per shard
    ],
)
def test_micro_batches_keep_rows_split_over_the_devices(overrides, width, want):
    """16 prompts x 8 samples on data 2 x fsdp 2: the fewest micro-batches whose rows per
    device fit the column budget, never a count whose rows or sequences would stop splitting
    over the 4 shards (packed rows: one per prompt; unpacked: one per completion)."""
    base = {"run_dir": "/tmp/unused", "rl.prompts_per_step": 16, "rl.group_size": 8}
    cfg = load_config("tiny.py", {**base, "mesh.data": 2, "mesh.fsdp": 2, **overrides})
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
    programs = types.SimpleNamespace(rl=cfg.rl, mesh=mesh, layout=Layout.for_platform("cpu"))
    packed = cfg.rl.pack_completions
    batch = types.SimpleNamespace(
        prompt_ids=jax.ShapeDtypeStruct((16, 100), jnp.int32),
        tokens=jax.ShapeDtypeStruct((128, width - 100), jnp.int32),
        packing=types.SimpleNamespace(src_BL=np.zeros((16, width - 100))) if packed else None,
    )
    assert StepPrograms.micro_batches(programs, batch) == want


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"model.lora_rank": 0},
        {"model.lora_rank": 0, "model.layer_loop": "unroll"},
        {"model.lora_rank": 0, "model.layer_loop": "scan", "model.remat": True},
    ],
    ids=["lora", "full", "full-unrolled", "full-remat-scan"],
)
def test_micro_batch_gradients_add_into_the_accumulator_inside_the_backward_pass(variant):
    """The policy loss given an accumulator returns, as its gradient, the accumulator plus its
    own (`fold_accumulator`; full fine-tuning adds the layers' share inside the layer scan):
    two micro-batches chained this way give the one-batch gradient of the two groups
    (float32; summed in another order, so rtol 1e-5)."""
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **variant)
    state = learner.init_state()
    rollout, _ = learner.collect(
        state.params,
        list(task.train_examples(0))[:2],
        jax.random.key(0),
        0,
        None,
        step_metrics.Timer(),
    )
    batch, _ = learner.prepare(state, rollout)
    # Nudge every weight (LoRA's B starts at zero, which would leave A without a gradient).
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nudged = [
        x + 1e-2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    params = treedef.unflatten(nudged)
    loss_fn = make_loss_fn(learner.programs.graphdef, learner.programs.objective)
    grad = jax.jit(jax.grad(lambda p, *a: loss_fn(p, learner.programs.frozen, batch, *a)[0]))
    whole = jnp.array([[0, 1]], jnp.int32)
    want = grad(params, whole[0], whole)
    split = jnp.array([[0], [1]], jnp.int32)
    acc = jax.tree.map(jnp.zeros_like, params)
    for idx_M in split:
        acc = grad(params, idx_M, split, acc)
    leaves = jax.tree_util.tree_leaves_with_path(acc)
    assert len(leaves) == len(jax.tree.leaves(want))
    for (path, got), w in zip(leaves, jax.tree.leaves(want), strict=True):
        scale = float(np.abs(w).max())
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            got, w, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )
