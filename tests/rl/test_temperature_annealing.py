"""Temperature annealing end to end: a config's step and position schedules reach every sampled
token, and the trainer scores each token at the temperature it was sampled at.

The tiny random model, the tiny config and a reward that varies with the sampled text (so every
group has non-zero advantages): see tests/learner_helpers.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from learner_helpers import make_learner

from jaxgrpo.core.sharding import to_host

LEVELS = (1.5, 1.0, 0.6)  # the step schedule: piecewise over steps 0 | 1 | 2
POSITION_END = 0.5  # the position multiplier falls linearly from 1 to this over T positions


@pytest.fixture(scope="module")
def annealed_run():
    overrides = {
        "steps": 3,
        "rl.beta": 0.0,
        "optim.max_grad_norm": 0.0,
        "sampling.temperature": LEVELS[0],
        "sampling.temperature_schedule.kind": "piecewise",
        "sampling.temperature_schedule.boundaries": (1, 2),
        "sampling.temperature_schedule.levels": LEVELS,
        "sampling.position_schedule.kind": "linear",
        "sampling.position_schedule.end": POSITION_END,
    }
    learner, task = make_learner({"data": 1}, jax.devices()[:1], **overrides)
    rollouts, params = [], []
    prepare = learner.prepare

    def recording_prepare(state, rollout, *timer):
        rollouts.append(rollout)
        params.append(jax.tree.map(jnp.copy, state.params))  # the update donates the state
        return prepare(state, rollout, *timer)

    learner.prepare = recording_prepare
    state = learner.init_state()
    examples = list(task.train_examples(0))
    history = []
    for step in range(3):
        state, metrics, samples = learner.step(state, examples[2 * step : 2 * step + 2])
        history.append((metrics, samples))
    return {"learner": learner, "rollouts": rollouts, "params": params, "history": history}


def test_every_token_is_sampled_at_its_scheduled_temperature(annealed_run):
    t = annealed_run["learner"].cfg.sampling.max_new_tokens
    multiplier_T = 1.0 + (POSITION_END - 1.0) * np.minimum(np.arange(t) / t, 1.0)
    for step, (rollout, (metrics, _)) in enumerate(
        zip(annealed_run["rollouts"], annealed_run["history"], strict=True)
    ):
        expected_RT = np.broadcast_to(LEVELS[step] * multiplier_T, rollout.temps.shape)
        np.testing.assert_allclose(rollout.temps, expected_RT, rtol=1e-6, err_msg=f"step {step}")
        assert metrics["temperature"] == pytest.approx(LEVELS[step])
        # The trainer's log-probs at each token's own temperature equal the sampler's.
        assert metrics["sampler_logp_gap"] < 1e-4, (step, metrics["sampler_logp_gap"])


def test_update_gradient_equals_the_one_from_log_softmax_of_logits_over_token_temperature(
    annealed_run,
):
    """The step's gradient norm against the GRPO gradient written out by hand: on-policy
    (r = 1, nothing clipped, beta = 0) the loss is -(1/N) sum_i A_i / n_i sum_t r_it with
    r = exp(logp - stop_gradient(logp)) and logp_it = log_softmax(logits_it / T_it)[token_it]."""
    learner = annealed_run["learner"]
    step = 2  # temperatures 0.6 x (1 -> 0.5): far from 1
    rollout, params = annealed_run["rollouts"][step], annealed_run["params"][step]
    metrics, samples = annealed_run["history"][step]
    adv_R = np.asarray([s["advantage"] for s in samples], np.float32)
    assert np.abs(adv_R).max() > 0, "the test reward must give non-zero advantages"
    g = learner.rl.group_size
    p = rollout.prompt_ids.shape[1]
    ids_RS = np.concatenate([np.repeat(rollout.prompt_ids, g, 0), rollout.tokens], axis=1)
    mask_RS = np.concatenate([np.repeat(rollout.prompt_mask, g, 0), rollout.mask], axis=1)
    mask_RT = rollout.mask.astype(np.float32)
    n_R = np.maximum(mask_RT.sum(1), 1.0)

    def loss(trainable):
        model = nnx.merge(learner.programs.graphdef, trainable, learner.programs.frozen)
        logits_RSV = model(jnp.asarray(ids_RS), jnp.asarray(mask_RS)).astype(jnp.float32)
        logits_RTV = logits_RSV[:, p - 1 : -1] / jnp.asarray(rollout.temps)[..., None]
        logp_RTV = jax.nn.log_softmax(logits_RTV, axis=-1)
        logp_RT = jnp.take_along_axis(logp_RTV, jnp.asarray(rollout.tokens)[..., None], -1)[..., 0]
        ratio_RT = jnp.exp(logp_RT - jax.lax.stop_gradient(logp_RT))
        per_seq_R = jnp.sum(ratio_RT * mask_RT, axis=1) / n_R
        return -jnp.mean(jnp.asarray(adv_R) * per_seq_R)

    grads = jax.grad(loss)(params)
    norm = float(optax.global_norm(jax.tree.map(to_host, grads)))
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4), (metrics["grad_norm"], norm)
