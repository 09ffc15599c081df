"""Training on episodes with tools: tool results are attended but never trained, in every loss
and normaliser; the learner runs an agent's episodes, scores them (an environment's reward
included), logs their metrics and samples, and scores the continued turns as one forward pass
over the whole episode does.

The loss tests build a rollout by hand (random ids, a tool result in the middle of every
completion); the learner tests use a scripted first turn (a stand-in for the model that
writes a tool call) and the tiny model's own sampler for every later turn.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_helpers import make_learner

from jaxgrpo.agents import Agent
from jaxgrpo.core.sharding import to_host
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl import step_metrics
from jaxgrpo.rl.objective import ObjectiveSpec, make_loss_fn

T = 16  # sampling.max_new_tokens
TOOL = slice(3, 7)  # the columns of every completion that a tool's result fills


@pytest.fixture(scope="module")
def plain():
    """A learner (LoRA, KL and an entropy bonus) and an episode batch built by hand."""
    learner, _ = make_learner(
        {"data": 1}, jax.devices()[:1], **{"sampling.max_new_tokens": T, "rl.entropy_coef": 0.01}
    )
    b, g = learner.rl.prompts_per_step, learner.rl.group_size
    n = b * g
    rng = np.random.default_rng(0)
    lengths = rng.integers(9, T + 1, n).astype(np.int32)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    model_mask = mask.copy()
    model_mask[:, TOOL] = 0
    rewards = rng.normal(size=n).astype(np.float32)
    rollout = ro.Rollout(
        examples=[{"messages": [], "answer": str(i)} for i in range(b)],
        prompt_ids=rng.integers(3, 200, (b, 8)).astype(np.int32),
        prompt_mask=np.ones((b, 8), np.int32),
        tokens=(rng.integers(3, 200, (n, T)) * mask).astype(np.int32),
        mask=mask,
        logprobs=np.zeros((n, T), np.float32),
        temps=np.ones((n, T), np.float32),
        stop_reason=np.ones(n, np.int32),
        lengths=lengths,
        prompts=["p"] * n,
        completions=["c"] * n,
        rewards=rewards,
        per_fn={"r": rewards},
        weights={"r": 1.0},
        correct=None,
        model_mask=model_mask,
    )
    state = learner.init_state()
    # Nudge every weight: LoRA's B starts at zero, and the policy would equal the reference.
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nudged = [
        x + 1e-2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    params = treedef.unflatten(nudged)
    return learner, rollout, state, params


def _loss_and_grad(learner, params, batch, loss_type, distill_coef=0.0):
    rl = dataclasses.replace(learner.rl, loss_type=loss_type)
    spec = ObjectiveSpec.from_config(
        rl, learner.cfg.sampling, use_old_logp=False, distill_coef=distill_coef
    )
    loss_fn = make_loss_fn(learner.programs.graphdef, spec)
    b = learner.rl.prompts_per_step
    idx = jnp.arange(b, dtype=jnp.int32)

    def f(p):
        return loss_fn(p, learner.programs.frozen, batch, idx, idx[None])

    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.leaves(grad)


def _close(a, b, rtol):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(to_host(x), to_host(y), rtol=rtol, atol=rtol * 1e-3)


def test_completion_length_counts_the_models_ids_and_tool_length_the_rest(plain):
    """``completion/length_mean`` is TRL's: the model's ids only; the results' ids beside it."""
    _, rollout, _, _ = plain
    m = step_metrics.step_metrics(rollout, {"adv_metrics": {}}, {}, {"sampling": 1.0})
    model = rollout.model_mask.sum(axis=1)
    assert m["completion/length_mean"] == pytest.approx(model.mean())
    assert m["completion/tool_length_mean"] == pytest.approx((rollout.lengths - model).mean())
    assert m["completion/tool_length_mean"] == pytest.approx(TOOL.stop - TOOL.start)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_tool_results_are_attended_but_never_trained(plain, loss_type):
    """Sequence-level (grpo), token-level (dapo) and Dr. GRPO's constant: the policy loss is
    the formula over the model's ids only; whatever the per-token fields hold at the tool's ids
    (sampler, old and reference log-probs, temperatures), the loss and gradient are the same;
    and the tool's ids themselves are attended (changing them changes the loss)."""
    learner, rollout, state, params = plain
    batch, extra = learner.prepare(state, rollout)
    loss, metrics, grad = _loss_and_grad(learner, params, batch, loss_type)

    # The policy loss on-policy (ratio 1) counts the model's ids alone.
    adv = extra["advantages"].astype(np.float64)
    n_model = rollout.model_mask.sum(axis=1).astype(np.float64)
    want = {
        "grpo": -adv.mean(),
        "dapo": -(adv * n_model).sum() / n_model.sum(),
        "dr_grpo": -(adv * n_model).sum() / (len(adv) * T),
    }[loss_type]
    assert metrics["policy_loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert metrics["kl_mean"] > 0 and metrics["entropy_mean"] > 0

    rng = np.random.default_rng(1)
    tool = (rollout.mask == 1) & (rollout.model_mask == 0)

    def at_tool(x, values):
        return jnp.where(tool, values.astype(np.float32), x)

    noise = rng.normal(size=tool.shape) * 5
    changed = dataclasses.replace(
        batch,
        sampler_logp=at_tool(batch.sampler_logp, noise),
        old_logp=at_tool(batch.old_logp, noise - 1),
        ref_logp=at_tool(batch.ref_logp, noise + 3),
        temps=at_tool(batch.temps, rng.uniform(0.2, 3.0, tool.shape)),
    )
    loss2, metrics2, grad2 = _loss_and_grad(learner, params, changed, loss_type)
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for key in ("policy_loss", "kl_mean", "entropy_mean", "sampler_logp_gap"):
        assert metrics2[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key
    _close(grad2, grad, 1e-6)

    other_ids = jnp.where(tool, (batch.tokens + 5) % 200, batch.tokens)
    loss3, _, _ = _loss_and_grad(learner, params, batch.replace(tokens=other_ids), loss_type)
    assert abs(loss3 - loss) > 1e-6, "the ids after a result must attend it"


def test_tool_results_get_no_distillation_term(plain):
    """A teacher's log-probs at the tool's ids change nothing (the term lives on the model's
    ids alone); at the model's ids they move the loss."""
    learner, rollout, state, params = plain
    batch, _ = learner.prepare(state, rollout)
    batch = batch.replace(teacher_logp=batch.ref_logp - 0.5)
    loss, metrics, grad = _loss_and_grad(learner, params, batch, "dapo", distill_coef=0.5)
    tool = (rollout.mask == 1) & (rollout.model_mask == 0)
    model = rollout.model_mask == 1
    noise = np.random.default_rng(2).normal(size=tool.shape).astype(np.float32) * 5
    at_tool = batch.replace(teacher_logp=jnp.where(tool, noise, batch.teacher_logp))
    loss2, metrics2, grad2 = _loss_and_grad(learner, params, at_tool, "dapo", distill_coef=0.5)
    assert loss2 == pytest.approx(loss, rel=1e-6)
    assert metrics2["distill_reverse_kl"] == pytest.approx(metrics["distill_reverse_kl"])
    _close(grad2, grad, 1e-6)
    at_model = batch.replace(teacher_logp=jnp.where(model, noise, batch.teacher_logp))
    loss3, _, _ = _loss_and_grad(learner, params, at_model, "dapo", distill_coef=0.5)
    assert abs(loss3 - loss) > 1e-4


def test_packed_episodes_score_as_unpacked_ones(plain):
    """Completions made of several segments (model, tool, model) packed end to end give the
    loss and gradient of scoring each completion in its own row, and equal reference log-probs."""
    learner, rollout, state, params = plain
    packed, _ = learner.prepare(state, rollout)
    loss, _, grad = _loss_and_grad(learner, params, packed, "dapo")
    saved = learner.rl
    learner.rl = learner.programs.rl = dataclasses.replace(saved, pack_completions=False)
    learner.programs.build()
    try:
        unpacked, _ = learner.prepare(state, rollout)
        loss_u, _, grad_u = _loss_and_grad(learner, params, unpacked, "dapo")
    finally:
        learner.rl = learner.programs.rl = saved
        learner.programs.build()
    assert packed.packing is not None and unpacked.packing is None
    valid = rollout.mask.astype(bool)  # packed scoring leaves the columns past the end at 0
    np.testing.assert_allclose(
        to_host(packed.ref_logp)[valid], to_host(unpacked.ref_logp)[valid], atol=1e-5
    )
    assert loss == pytest.approx(loss_u, rel=1e-5)
    _close(grad, grad_u, 1e-4)


# ----------------------------------------------------------------------------------------------
# The learner's episodes.


class Tally:
    """An environment as a TRL user writes one: state per episode, a tool, and a reward."""

    def reset(self, **kwargs):
        self.calls = 0
        return f" (question {kwargs['answer']})"

    def bump(self, note: str) -> str:
        """Counts a call.

        Args:
            note: anything.
        """
        self.calls += 1
        return f"tally {self.calls} ({note})"

    def get_reward(self) -> float:
        return float(self.calls)


CALL = "<bump>up</bump>"  # the tag format: answered by <result>...</result> in the same turn


@pytest.fixture(scope="module")
def agent_run():
    """One step of a learner whose every episode calls the environment's tool in a scripted
    first turn (the tag format keeps the tiny byte-level tokenizer's prompts short) and
    continues with the tiny model's own samples."""
    learner, task = make_learner(
        {"data": 1},
        jax.devices()[:1],
        agent=lambda tok: Agent([], Tally, tok, format="tag"),
        **{"sampling.max_new_tokens": 64},
    )
    tok = learner.tokenizer
    call_ids = tok.hf.encode(CALL, add_special_tokens=False)
    real = learner.turn_sampler

    def turn_sampler(params, settings, key):
        sample = real(params, settings, key)

        def scripted(ids, mask, num_samples, max_lengths, turn, resume=None):
            # Later turns sample the whole context afresh: the cache of turn 0 holds what the
            # model drew, not the scripted call (tests/agents/test_rollout.py checks turns
            # continued from the cache against one pass).
            out = sample(ids, mask, num_samples, max_lengths, turn)
            out = {k: np.array(v) for k, v in out.items()}
            if turn == 0:  # every row writes the call
                out["tokens"][:] = tok.pad_id
                out["tokens"][:, : len(call_ids)] = call_ids
                out["lengths"][:] = len(call_ids)
            return out

        return scripted

    learner.turn_sampler = turn_sampler
    examples = list(task.train_examples(0))[:2]
    state = learner.init_state()
    timer = step_metrics.Timer()
    rollout, _ = learner.collect(state.params, examples, jax.random.key(0), 0, None, timer)
    batch, _ = learner.prepare(state, rollout)
    state, metrics, samples = learner.step(state, examples)
    return {
        "rollout": rollout,
        "batch": batch,
        "metrics": metrics,
        "samples": samples,
        "call_ids": call_ids,
        "learner": learner,
        "examples": examples,
        "state": state,
    }


def test_the_learner_runs_scores_and_logs_episodes(agent_run):
    r, m = agent_run["rollout"], agent_run["metrics"]
    n_call = len(agent_run["call_ids"])
    assert r.episodes is not None and len(r.episodes) == r.tokens.shape[0]
    for i, episode in enumerate(r.episodes):
        assert episode.tool_calls == 1 and episode.turns[0].results[0].text == "tally 1 (up)"
        assert (r.model_mask[i, :n_call] == 1).all(), "the call is the model's"
        tool = np.flatnonzero((r.mask[i] == 1) & (r.model_mask[i] == 0))
        assert tool.size and tool[0] == n_call, "the result follows the call"
        assert "tally 1 (up)" in agent_run["learner"].tokenizer.hf.decode(
            r.tokens[i, tool].tolist()
        )
        assert (r.logprobs[i, tool] == 0).all() and (r.temps[i, tool] == 1).all()
    assert "(question " in r.prompts[0], "reset's text follows the last user message"
    # The environment's reward, under its class's name: every episode called once.
    np.testing.assert_array_equal(r.per_fn["Tally"], 1.0)
    assert m["agent/tool_calls"] == 1.0 and m["agent/failed"] == 0.0
    assert 1.0 < m["agent/turns"] <= 2.0 and m["agent/tool_tokens"] > 0
    assert m["agent/model_tokens"] > n_call
    assert m["completion/length_mean"] == m["agent/model_tokens"], "the model's ids only"
    assert m["completion/tool_length_mean"] == m["agent/tool_tokens"]
    assert m["reward/Tally/mean"] == 1.0
    sample = agent_run["samples"][0]
    assert sample["turns"][0]["calls"][0] == {
        "name": "bump",
        "arguments": {"note": "up"},
        "result": "tally 1 (up)",
        "error": None,
    }
    assert sample["model_tokens"] < sample["length"]


def test_continued_turns_score_as_one_forward_over_the_episode(agent_run):
    """The reference pass (one forward over prompt + whole episode; at step 0 the reference is
    the policy) gives the sampler's log-probs of every id the model drew after the result."""
    r, batch = agent_run["rollout"], agent_run["batch"]
    ref = to_host(batch.ref_logp)
    n_call = len(agent_run["call_ids"])
    later = r.model_mask[:, : ref.shape[1]].astype(bool)
    later[:, :n_call] = False  # the scripted call's log-probs are not the model's
    assert later.sum() > 10
    np.testing.assert_allclose(ref[later], r.logprobs[:, : ref.shape[1]][later], atol=1e-5)
    assert (to_host(batch.loss_mask) <= r.model_mask[:, : ref.shape[1]]).all()


def test_held_out_evaluation_runs_episodes(agent_run):
    learner = agent_run["learner"]
    m = learner.evaluate(agent_run["state"], agent_run["examples"])
    assert m["num_examples"] == 2
    assert "agent/tool_calls" in m and "reward/Tally/mean" in m
    assert m["length_mean"] == m["agent/model_tokens"]
    assert m["tool_length_mean"] == m["agent/tool_tokens"]
