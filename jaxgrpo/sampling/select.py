"""Choosing the next token from logits: temperature, top-k, min-p, top-p, greedy.

Everything here is traced except ``top_k`` (``lax.top_k`` needs a static k): temperature, top-p
and min-p are arrays, so changing them between calls never recompiles (DESIGN.md section 5).

The log-probability returned for a token is always taken under the temperature-scaled,
*untruncated* distribution ``log_softmax(logits / T)``: that is the density the policy loss
re-computes from the trainer's forward pass, so the sampler's value can serve as the "old"
log-probability. Greedy rows (``T <= 0``) report ``log_softmax(logits)`` (T = 1).
"""

import jax
import jax.numpy as jnp

from jaxgrpo.types import Array

_NEG_INF = -jnp.inf


def _top_k_mask(logp_NV: Array, top_k: int) -> Array:
    """Keeps the ``top_k`` largest entries of each row (ties at the k-th value are kept)."""
    kth_N1 = jax.lax.top_k(logp_NV, top_k)[0][:, -1:]
    return jnp.where(logp_NV < kth_N1, _NEG_INF, logp_NV)


def _min_p_mask(logp_NV: Array, min_p: Array) -> Array:
    """Drops tokens whose probability is below ``min_p`` times the row's largest probability."""
    # log(0) = -inf keeps everything, so min_p = 0 needs no special case.
    floor_N1 = jnp.max(logp_NV, axis=-1, keepdims=True) + jnp.log(min_p)
    return jnp.where(logp_NV < floor_N1, _NEG_INF, logp_NV)


def _top_p_mask(logp_NV: Array, top_p: Array) -> Array:
    """Keeps the smallest set of most likely tokens whose total probability reaches ``top_p``.

    ``logp_NV`` is renormalised first, so top-p acts on what top-k / min-p left (as in HF's
    warper chain). A token is kept when the mass of the tokens strictly more likely than it is
    below ``top_p``; the most likely token is therefore always kept.
    """
    logp_NV = jax.nn.log_softmax(logp_NV, axis=-1)
    sorted_NV = -jnp.sort(-logp_NV, axis=-1)
    probs_NV = jnp.exp(sorted_NV)
    mass_before_NV = jnp.cumsum(probs_NV, axis=-1) - probs_NV
    keep_NV = mass_before_NV < top_p
    threshold_N1 = jnp.min(jnp.where(keep_NV, sorted_NV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logp_NV < threshold_N1, _NEG_INF, logp_NV)


def truncate(logp_NV: Array, top_p: Array, min_p: Array, *, top_k: int) -> Array:
    """Applies top-k (static), min-p and top-p (traced) by setting dropped entries to -inf.

    Args:
      logp_NV: float32 [N, V] temperature-scaled log-probabilities (or logits).
      top_p: float32 scalar in (0, 1]; 1 disables it.
      min_p: float32 scalar in [0, 1); 0 disables it.
      top_k: static int; 0 disables it.

    Returns:
      float32 [N, V]: the same values, -inf outside the kept set (unnormalised).
    """
    if top_k > 0:
        logp_NV = _top_k_mask(logp_NV, top_k)
    logp_NV = _min_p_mask(logp_NV, min_p)
    # The full-vocabulary sort costs several ms per step on CPU: skip it unless top-p is active.
    return jax.lax.cond(top_p < 1.0, _top_p_mask, lambda x, _: x, logp_NV, top_p)


def select_tokens(
    rng: Array,
    logits_NV: Array,
    temperature_N: Array,
    top_p: Array,
    min_p: Array,
    *,
    top_k: int,
) -> tuple[Array, Array]:
    """Samples one token per row and returns its untruncated log-probability.

    Args:
      rng: PRNG key for this step.
      logits_NV: float32 [N, V] next-token logits.
      temperature_N: float32 [N]; rows with temperature <= 0 are greedy.
      top_p: float32 scalar nucleus mass (1 = off).
      min_p: float32 scalar min-p ratio (0 = off).
      top_k: static int (0 = off).

    Returns:
      (token_N int32, logprob_N float32), logprob under ``log_softmax(logits / T)`` with T = 1
      for greedy rows.
    """
    logits_NV = logits_NV.astype(jnp.float32)
    greedy_N = temperature_N <= 0.0
    # Greedy rows divide by 1 so no row ever divides by zero; the choice is traced, not static.
    safe_t_N1 = jnp.where(greedy_N, 1.0, temperature_N)[:, None]
    logp_NV = jax.nn.log_softmax(logits_NV / safe_t_N1, axis=-1)
    sampled_N = jax.random.categorical(rng, truncate(logp_NV, top_p, min_p, top_k=top_k))
    token_N = jnp.where(greedy_N, jnp.argmax(logits_NV, axis=-1), sampled_N).astype(jnp.int32)
    logprob_N = jnp.take_along_axis(logp_NV, token_N[:, None], axis=-1)[:, 0]
    return token_N, logprob_N
