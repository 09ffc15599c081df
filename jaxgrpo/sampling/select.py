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

from jaxgrpo.core.shapes import Array

_NEG_INF = -jnp.inf


_CHUNK = 256  # two-level sampling block: random draws per row drop from V to V/256 + 256


def _top_k_mask(x_RV: Array, top_k: int) -> Array:
    """Keeps the ``top_k`` largest entries of each row (ties at the k-th value are kept)."""
    kth_R1 = jax.lax.top_k(x_RV, top_k)[0][:, -1:]
    return jnp.where(x_RV < kth_R1, _NEG_INF, x_RV)


def _min_p_mask(x_RV: Array, min_p: Array) -> Array:
    """Drops tokens whose probability is below ``min_p`` times the row's largest probability."""
    # On logits, p_i / p_max = exp(x_i - x_max); log(0) = -inf keeps everything when min_p = 0.
    floor_R1 = jnp.max(x_RV, axis=-1, keepdims=True) + jnp.log(min_p)
    return jnp.where(x_RV < floor_R1, _NEG_INF, x_RV)


def _top_p_mask(x_RV: Array, top_p: Array) -> Array:
    """Keeps the smallest set of most likely tokens whose total probability reaches ``top_p``.

    Acts on what top-k / min-p left (renormalised, as in HF's warper chain). Sorting the
    vocabulary costs over a second per step on CPU, so instead we bisect on the float32 bit
    pattern of the threshold probability tau (bit patterns of non-negative floats are ordered
    like the floats): 31 halvings find exactly the largest tau whose kept mass
    ``sum(p[p >= tau])`` still reaches ``top_p``, i.e. the smallest probability in the nucleus.
    """
    p_RV = jnp.exp(x_RV - jnp.max(x_RV, axis=-1, keepdims=True))  # in [0, 1], max exactly 1
    target_R1 = top_p * jnp.sum(p_RV, axis=-1, keepdims=True)
    n = x_RV.shape[0]
    one_bits = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
    lo_R1 = jnp.zeros((n, 1), jnp.int32)  # mass(0) = total >= target always
    hi_R1 = jnp.full((n, 1), one_bits + 1, jnp.int32)  # mass(> 1) = 0 < target

    def halve(_, bounds):
        lo_R1, hi_R1 = bounds
        mid_R1 = lo_R1 + (hi_R1 - lo_R1) // 2
        tau_R1 = jax.lax.bitcast_convert_type(mid_R1, jnp.float32)
        mass_R1 = jnp.sum(jnp.where(p_RV >= tau_R1, p_RV, 0.0), axis=-1, keepdims=True)
        ok_R1 = mass_R1 >= target_R1
        return jnp.where(ok_R1, mid_R1, lo_R1), jnp.where(ok_R1, hi_R1, mid_R1)

    lo_R1, _ = jax.lax.fori_loop(0, 31, halve, (lo_R1, hi_R1))
    tau_R1 = jax.lax.bitcast_convert_type(lo_R1, jnp.float32)
    return jnp.where(p_RV < tau_R1, _NEG_INF, x_RV)


def truncate(x_RV: Array, top_p: Array, min_p: Array, *, top_k: int) -> Array:
    """Applies top-k (static), min-p and top-p (traced) by setting dropped entries to -inf.

    Args:
      x_RV: float32 [R, V] temperature-scaled logits.
      top_p: float32 scalar in (0, 1]; 1 disables it.
      min_p: float32 scalar in [0, 1); 0 disables it.
      top_k: static int; 0 disables it.

    Returns:
      float32 [R, V]: the same values, -inf outside the kept set (unnormalised).
    """
    if top_k > 0:
        x_RV = _top_k_mask(x_RV, top_k)

    def min_p_then_top_p(x_RV):
        x_RV = _min_p_mask(x_RV, min_p)
        # The top-p search costs 31 passes over the logits: skip it unless top-p is active.
        return jax.lax.cond(top_p < 1.0, _top_p_mask, lambda x, _: x, x_RV, top_p)

    # Plain sampling (the GRPO default) skips both passes over the vocabulary entirely.
    return jax.lax.cond((top_p < 1.0) | (min_p > 0.0), min_p_then_top_p, lambda x: x, x_RV)


def _gumbel_rows(rng: Array, shape: tuple[int, int], rows_R: Array | None) -> Array:
    """Gumbel noise [len(rows), shape[1]]: rows ``rows_R`` of a [shape[0], shape[1]] draw.

    Row r's noise depends on the key and r only, so a row gets the same draw whichever rows
    share its batch (the sampler drops finished rows from the batch mid-way).
    """
    noise = jax.random.gumbel(rng, shape, jnp.float32)
    return noise if rows_R is None else jnp.take(noise, rows_R, axis=0)


def categorical(
    rng: Array, x_RV: Array, rows_R: Array | None = None, num_rows: int | None = None
) -> Array:
    """Exact draw from ``softmax(x_RV)`` per row, in two levels to save random numbers.

    A Gumbel-max draw over all V tokens of every row costs more than the model's step on CPU
    (benchmarks/README.md, "Two-level categorical draw"). We draw a block of 256 tokens
    from the blocks' total masses, then a token inside the block: P(block) * P(token | block)
    is the same distribution with V / 256 + 256 random numbers per row.

    Args:
      rng: PRNG key.
      x_RV: float32 [R, V] unnormalised log-probabilities (-inf = excluded).
      rows_R: int32 [R], which rows of a ``num_rows``-row batch these are (default: all, in
        order); row r always gets the same random numbers for a given key.
      num_rows: the full batch's row count (static; with ``rows_R``).

    Returns:
      int32 [R] token ids.
    """
    n, v = x_RV.shape
    total = n if rows_R is None else num_rows
    if v <= 4 * _CHUNK:
        return jnp.argmax(x_RV + _gumbel_rows(rng, (total, v), rows_R), axis=-1).astype(jnp.int32)
    num_c = -(-v // _CHUNK)
    x_RCW = jnp.pad(x_RV, ((0, 0), (0, num_c * _CHUNK - v)), constant_values=_NEG_INF)
    x_RCW = x_RCW.reshape(n, num_c, _CHUNK)
    block_rng, token_rng = jax.random.split(rng)
    block_RC = jax.nn.logsumexp(x_RCW, axis=-1) + _gumbel_rows(block_rng, (total, num_c), rows_R)
    block_R = jnp.argmax(block_RC, axis=-1)
    x_RW = jnp.take_along_axis(x_RCW, block_R[:, None, None], axis=1)[:, 0]
    token_R = jnp.argmax(x_RW + _gumbel_rows(token_rng, (total, _CHUNK), rows_R), axis=-1)
    return (block_R * _CHUNK + token_R).astype(jnp.int32)


def select_tokens(
    rng: Array,
    logits_RV: Array,
    temperature_R: Array,
    top_p: Array,
    min_p: Array,
    *,
    top_k: int,
    rows_R: Array | None = None,
    num_rows: int | None = None,
) -> tuple[Array, Array]:
    """Samples one token per row and returns its untruncated log-probability.

    Args:
      rng: PRNG key for this step.
      logits_RV: float32 [R, V] next-token logits.
      temperature_R: float32 [R]; rows with temperature <= 0 are greedy.
      top_p: float32 scalar nucleus mass (1 = off).
      min_p: float32 scalar min-p ratio (0 = off).
      top_k: static int (0 = off).
      rows_R / num_rows: as in ``categorical``: these rows' places in the full batch.

    Returns:
      (token_R int32, logprob_R float32), logprob under ``log_softmax(logits / T)`` with T = 1
      for greedy rows.
    """
    logits_RV = logits_RV.astype(jnp.float32)
    greedy_R = temperature_R <= 0.0
    # Greedy rows divide by 1 so no row ever divides by zero; the choice is traced, not static.
    safe_t_R1 = jnp.where(greedy_R, 1.0, temperature_R)[:, None]
    x_RV = logits_RV / safe_t_R1
    sampled_R = categorical(rng, truncate(x_RV, top_p, min_p, top_k=top_k), rows_R, num_rows)
    token_R = jnp.where(greedy_R, jnp.argmax(logits_RV, axis=-1), sampled_R).astype(jnp.int32)
    x_R = jnp.take_along_axis(x_RV, token_R[:, None], axis=-1)[:, 0]
    return token_R, x_R - jax.nn.logsumexp(x_RV, axis=-1)
