"""Hypothesis properties of the policy losses and KL estimators (no reference implementation).

Inputs keep the ``[8, 9]`` float32 shape of the other loss tests so the eager JAX op cache is
shared; examples are few (``max_examples`` small) and derandomized so CI is reproducible.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxgrpo.rl.kl import kl_estimate
from jaxgrpo.rl.loss_spec import LOSS_PRESETS, Objective
from jaxgrpo.rl.losses import policy_loss

N, T = 8, 9
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)
logps = hnp.arrays(np.float32, (N, T), elements=st.floats(-6.0, -0.125, width=32))
shifts = hnp.arrays(np.float32, (N, T), elements=st.floats(-1.0, 1.0, width=32))
lengths = hnp.arrays(np.int64, (N,), elements=st.integers(0, T))


def _mask(lengths_R):
    return np.arange(T)[None, :] < np.asarray(lengths_R)[:, None]


def _grad(logp, old_logp, advantages, mask, **kw):
    """d loss / d logp of the ``Objective.preset(**kw)`` loss."""
    objective = Objective.preset(**kw)
    fn = lambda lp: policy_loss(lp, old_logp, None, advantages, mask, objective)[0]
    return np.asarray(jax.grad(fn)(jnp.asarray(logp)))


@SETTINGS
@given(logp=logps, shift=shifts, lens=lengths)
def test_zero_advantages_give_zero_policy_gradient(logp, shift, lens):
    zeros = np.zeros(N, np.float32)
    for loss_type in LOSS_PRESETS:
        g = _grad(logp, logp + shift, zeros, _mask(lens), loss_type=loss_type, dual_clip=3.0)
        np.testing.assert_array_equal(g, 0.0, err_msg=loss_type)


@SETTINGS
@given(
    logp=logps,
    adv=hnp.arrays(np.float32, (N,), elements=st.floats(-3.0, 3.0, width=32)),
    lens=lengths,
    eps=st.tuples(st.floats(0.01, 0.5), st.floats(0.01, 0.5)),
)
def test_clipped_gradient_equals_reinforce_at_ratio_one(logp, adv, lens, eps):
    """At r = 1: d/dlogp [-min(r A, clip(r) A)] = -r A = -A = d/dlogp [-logp A]."""
    mask = _mask(lens)
    for aggregation in ("seq_mean_token_mean", "token_mean", "constant"):
        kw = dict(aggregation=aggregation, eps_low=eps[0], eps_high=eps[1])
        clip = _grad(logp, logp, adv, mask, surrogate="clip", **kw)
        reinforce = _grad(logp, logp, adv, mask, surrogate="reinforce", **kw)
        np.testing.assert_allclose(clip, reinforce, rtol=1e-6, atol=1e-7, err_msg=aggregation)


@SETTINGS
@given(logp=logps, d=hnp.arrays(np.float32, (N, T), elements=st.floats(-20.0, 20.0, width=32)))
def test_kl_estimators_vanish_at_zero_and_k3_is_nonnegative(logp, d):
    for est in ("k1", "k2", "k3"):
        np.testing.assert_array_equal(kl_estimate(logp, logp, est), 0.0, err_msg=est)
    k3 = np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(logp + d), "k3"))
    assert np.all(k3 >= 0), d[k3 < 0]
    assert np.all(np.asarray(kl_estimate(logp, logp + d, "k2")) >= 0)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    logits=hnp.arrays(np.float32, (2, 6), elements=st.floats(-3.0, 3.0, width=32)),
    seed=st.integers(0, 2**31 - 1),
)
def test_k3_monte_carlo_mean_approaches_exact_kl(logits, seed):
    """Mean of k3 over M samples from pi is within 5 standard errors (+1e-4) of KL(pi||pi_ref).

    Tokens are drawn with numpy (the estimator, not the sampler, is under test)."""
    logits = logits.astype(np.float64)
    logpi_V, logref_V = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    exact = float(np.sum(np.exp(logpi_V) * (logpi_V - logref_V)))
    tokens_M = np.random.default_rng(seed).choice(logpi_V.size, 20000, p=np.exp(logpi_V))
    k3_M = np.asarray(kl_estimate(logpi_V[tokens_M], logref_V[tokens_M], "k3"), np.float64)
    stderr = k3_M.std() / np.sqrt(k3_M.size)
    assert abs(k3_M.mean() - exact) <= 5 * stderr + 1e-4, (k3_M.mean(), exact, stderr)


@SETTINGS
@given(logp=logps, lens=lengths, pair=st.tuples(st.integers(1, T), st.integers(1, T)))
def test_dr_grpo_removes_the_length_bias_of_grpo(logp, lens, pair):
    """On-policy, a token of a length-L sequence gets -A/(N*L) under "grpo" (shrinks with L)
    and -A/(N*T_max) under "dr_grpo" (independent of L)."""
    short, long = sorted(pair)
    adv = np.ones(N, np.float32)
    got = {}
    for length in (short, long):
        mask = _mask(np.concatenate([[length], lens[1:]]))
        for loss_type in ("grpo", "dr_grpo"):
            got[loss_type, length] = _grad(logp, logp, adv, mask, loss_type=loss_type)[0, 0]
    np.testing.assert_allclose(got["dr_grpo", short], got["dr_grpo", long], rtol=1e-6)
    np.testing.assert_allclose(got["dr_grpo", short], -1.0 / (N * T), rtol=1e-6)
    np.testing.assert_allclose(got["grpo", long], -1.0 / (N * long), rtol=1e-6)
    if long > short:
        assert abs(got["grpo", long]) < abs(got["grpo", short])
