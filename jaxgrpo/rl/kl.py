"""Sampled-token estimators of KL(pi || pi_ref), and the KL-in-reward alternative.

For a token sampled from the current policy ``pi``, with ``d = ref_logp - logp``
(the log of ``pi_ref / pi`` at that token), the estimators of ``KL(pi || pi_ref)`` are
(Schulman, "Approximating KL divergence", 2020):

* ``k1 = -d``: unbiased, but its value can be negative and, used as a loss on samples from
  ``pi``, its gradient is zero in expectation (``E_pi[grad log pi] = 0``), so it does not
  pull the policy towards the reference. It is allowed in the loss but warned about once.
* ``k2 = d**2 / 2``: biased, non-negative, low variance.
* ``k3 = exp(d) - d - 1``: unbiased (``E_pi[exp(d)] = 1``) and non-negative (``e^x >= 1 + x``);
  the estimator GRPO uses.

KL may instead be subtracted from the reward (``kl_penalized_rewards``): ``k1`` summed over
each completion's tokens, times ``beta``, without gradient.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxgrpo.core.shapes import Array

KL_ESTIMATORS = ("k1", "k2", "k3")

_warned_k1 = False


def kl_estimate(logp: Array, ref_logp: Array, estimator: str = "k3") -> Array:
    """Per-token estimate of KL(pi || pi_ref) from log-probabilities of sampled tokens.

    Args:
      logp: ``[R, T]`` log pi of the sampled tokens.
      ref_logp: ``[R, T]`` log pi_ref of the same tokens.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (static).

    Returns:
      ``[R, T]`` per-token estimates (no masking applied).
    """
    d_RT = ref_logp - logp
    if estimator == "k1":
        return -d_RT
    if estimator == "k2":
        return 0.5 * d_RT * d_RT
    if estimator == "k3":
        # expm1 keeps the k3 value accurate (and exactly 0 at d = 0) when d is tiny.
        return jnp.expm1(d_RT) - d_RT
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def warn_if_k1_in_loss(estimator: str, beta) -> None:
    """Warn once per process when k1 is used as a loss term (zero expected gradient on-policy).

    ``beta`` may be traced; only a Python ``0``/``0.0`` is taken as "KL off" and stays silent.
    """
    global _warned_k1
    if estimator != "k1" or _warned_k1:
        return
    if isinstance(beta, int | float) and beta == 0:
        return
    _warned_k1 = True
    warnings.warn(
        "kl_estimator='k1' in the loss: its gradient is zero in expectation on samples from "
        "the policy, so it does not regularise towards the reference. Use 'k3' (or 'k2') in "
        "the loss, or k1 in the reward via kl_penalized_rewards.",
        UserWarning,
        stacklevel=3,
    )


def kl_penalized_rewards(
    rewards: Array, logp: Array, ref_logp: Array, mask: Array, beta: float | Array
) -> tuple[Array, Array]:
    """KL in the reward: ``R_i - beta * sum_t k1_it`` over each completion's valid tokens.

    The penalty is a constant for the policy gradient (``stop_gradient``), as in PPO-RLHF.

    Args:
      rewards: ``[R]`` rewards.
      logp: ``[R, T]`` log pi of the sampled tokens (the behaviour policy's, usually).
      ref_logp: ``[R, T]`` log pi_ref of the same tokens.
      mask: ``[R, T]`` valid completion tokens (bool or 0/1).
      beta: KL coefficient (may be traced).

    Returns:
      ``(penalized_rewards [R], kl_R [R])`` with ``kl_R`` the summed k1 of each completion.
    """
    valid_RT = mask.astype(bool)
    k1_RT = jnp.where(valid_RT, logp - ref_logp, jnp.zeros_like(logp))
    kl_R = jax.lax.stop_gradient(jnp.sum(k1_RT, axis=-1))
    dtype = jnp.promote_types(rewards.dtype, kl_R.dtype)
    return rewards.astype(dtype) - beta * kl_R.astype(dtype), kl_R
