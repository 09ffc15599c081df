"""The LM head's per-token statistics: log-probability and entropy of sampled tokens, chunked.

A full `[B, S, V]` float32 logit tensor is the largest array of a step (Qwen's V is 152k).
`head_token_logprobs` computes logits only at the positions it is given, in chunks of
`chunk_size` positions whose hand-written VJP (`_head_stats`) recomputes each chunk's
`[R, C, V]` block instead of storing all of them, unless all of them together take at most
`KEEP_LOG_PROBS_BYTES` (then the backward pass reads them and skips a matmul). With a frozen
head (LoRA) and no entropy bonus, the forward pass keeps the log-prob's gradient with respect
to the hidden state instead, `[R, C, D]`, and the backward pass only scales it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxgrpo.core.shapes import Array

# Up to this many bytes of [R, T, V] float32 log-probabilities, the backward pass of a head
# that is trained (full fine-tuning) keeps them instead of recomputing the logits (the GRPO
# benchmark's 512 packed positions x SmolLM2's 49,152 tokens: 100 MB held, a [512, 576] x
# [576, 49152] matmul saved).
KEEP_LOG_PROBS_BYTES = 256 << 20


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_stats(
    h_RCD: Array, w_VD: Array, tokens_RC: Array, temps_RC: Array, dtype: Any, keep: bool
) -> tuple[Array, Array]:
    """Log-prob of `tokens_RC` and entropy under `softmax(h @ w.T / temperature)`.

    The backward pass is written by hand. Autodiff of the log-softmax keeps several [R, C, V]
    intermediates and walks them more often than needed; this backward forms
    d(loss)/d(logits) in one fused pass,
    dlogp * (onehot - p) - dentropy * p * (log p + entropy), all over the temperature,
    from the [R, C, V] log-probabilities: kept from the forward pass when `keep`, else
    recomputed (one matmul, so nothing [R, C, V] is held between the passes).

    With a frozen head (LoRA) and an entropy that is not differentiated (no entropy bonus),
    the forward pass instead multiplies (onehot - p) / temperature by the head at once: the
    log-prob's gradient with respect to h, [R, C, D], which the backward pass only scales by
    its cotangent. Two matmuls of [R, C, V] by [V, D] in all instead of three (the logits,
    their recomputation and the gradient), and nothing vocabulary-sized kept.
    """
    return _head_forward(h_RCD, w_VD, tokens_RC, temps_RC, dtype)[:2]


def _head_logits(h_RCD, w_VD, dtype):
    return jnp.einsum(
        "RCD,VD->RCV", h_RCD.astype(dtype), w_VD.astype(dtype), preferred_element_type=jnp.float32
    )


def _through_head(dz_RCV, w_VD, dtype):
    """[R, C, V] gradients times the head: their gradient with respect to h, float32."""
    return jnp.einsum(
        "RCV,VD->RCD", dz_RCV.astype(dtype), w_VD.astype(dtype), preferred_element_type=jnp.float32
    )


def _head_forward(h_RCD, w_VD, tokens_RC, temps_RC, dtype):
    """(log-prob, entropy, [R, C, V] log-probabilities, log-sum-exp) of the tempered logits."""
    z_RCV = _head_logits(h_RCD, w_VD, dtype) / temps_RC[..., None]
    lse_RC = jax.nn.logsumexp(z_RCV, axis=-1)
    logp_RC = jnp.take_along_axis(z_RCV, tokens_RC[..., None], axis=-1)[..., 0] - lse_RC
    logq_RCV = z_RCV - lse_RC[..., None]
    entropy_RC = -jnp.sum(jnp.exp(logq_RCV) * logq_RCV, axis=-1)
    return logp_RC, entropy_RC, logq_RCV, lse_RC


def _dlogits(logq_RCV, tokens_RC, temps_RC, dlogp_RC, dent_RC=None, entropy_RC=None):
    """d(loss)/d(logits) [R, C, V], float32: dlogp (onehot - p) - dent p (log p + entropy), all
    over the temperature (no entropy part without ``dent_RC``)."""
    n, c = tokens_RC.shape
    scale_RCV = dlogp_RC[..., None]
    if dent_RC is not None:
        scale_RCV = scale_RCV + dent_RC[..., None] * (logq_RCV + entropy_RC[..., None])
    dz_RCV = -jnp.exp(logq_RCV) * scale_RCV
    dz_RCV = dz_RCV.at[jnp.arange(n)[:, None], jnp.arange(c)[None, :], tokens_RC].add(dlogp_RC)
    return dz_RCV / temps_RC[..., None]


def _head_stats_fwd(h_RCD, w_VD, tokens_RC, temps_RC, dtype, keep):
    frozen_head = not w_VD.perturbed
    h_RCD, w_VD, tokens_RC, temps_RC = (x.value for x in (h_RCD, w_VD, tokens_RC, temps_RC))
    logp_RC, entropy_RC, logq_RCV, lse_RC = _head_forward(h_RCD, w_VD, tokens_RC, temps_RC, dtype)
    if frozen_head:
        dz_RCV = _dlogits(logq_RCV, tokens_RC, temps_RC, jnp.ones_like(logp_RC))
        kept = {"dlogp_dh": _through_head(dz_RCV, w_VD, dtype)}
    else:
        kept = {"logq": logq_RCV} if keep else {"lse": lse_RC}
    residuals = (h_RCD, w_VD, tokens_RC, temps_RC, kept, entropy_RC)
    return (logp_RC, entropy_RC), residuals


def _head_stats_bwd(dtype, keep, residuals, cotangents):
    h_RCD, w_VD, tokens_RC, temps_RC, kept, entropy_RC = residuals
    dlogp_RC, dent_RC = (
        jnp.zeros_like(entropy_RC) if isinstance(ct, SymbolicZero) else ct for ct in cotangents
    )
    if "dlogp_dh" in kept and isinstance(cotangents[1], SymbolicZero):
        dh_RCD = dlogp_RC[..., None] * kept["dlogp_dh"]
        return dh_RCD.astype(h_RCD.dtype), None, None, None
    if "logq" in kept:
        logq_RCV = kept["logq"]
    else:  # recompute the logits (also when a frozen head's entropy is differentiated)
        z_RCV = _head_logits(h_RCD, w_VD, dtype) / temps_RC[..., None]
        lse_RC = kept["lse"] if "lse" in kept else jax.nn.logsumexp(z_RCV, axis=-1)
        logq_RCV = z_RCV - lse_RC[..., None]
    dz_RCV = _dlogits(logq_RCV, tokens_RC, temps_RC, dlogp_RC, dent_RC, entropy_RC).astype(dtype)
    dh_RCD = _through_head(dz_RCV, w_VD, dtype)
    dw_VD = None
    if "dlogp_dh" not in kept:  # a trained head (a frozen one kept the product above)
        dw_VD = jnp.einsum(
            "RCV,RCD->VD", dz_RCV, h_RCD.astype(dtype), preferred_element_type=jnp.float32
        ).astype(w_VD.dtype)
    return dh_RCD.astype(h_RCD.dtype), dw_VD, None, None


_head_stats.defvjp(_head_stats_fwd, _head_stats_bwd, symbolic_zeros=True)


def head_chunk(rows: int, t: int, chunk_size: int = 64, min_rows: int = 0) -> int:
    """Positions per logits block of `head_token_logprobs` for `rows` rows of `t` positions:
    `chunk_size`, raised until a block has `min_rows` rows x positions (the run's
    `Layout.head_chunk_rows`); at most t."""
    floor = min_rows // max(rows, 1)
    return max(1, min(max(chunk_size, floor), t))


def head_token_logprobs(
    model: Any, h_RTD: Array, tokens_RT: Array, temps_RT: Array, chunk_size: int = 64
) -> tuple[Array, Array]:
    """Scores `tokens_RT` from the hidden states that predict them, chunk by chunk over T.

    Logits come from the model's linear LM head (`model.head_weight()`), C positions at a time
    under a scan; `_head_stats` keeps no chunk's [R, C, V] logits for the backward pass.

    Args:
        model: a `Transformer` (or anything with `head_weight()`, `cfg.dtype` and `cfg.layout`).
        h_RTD: hidden state at the position before each token (h_RTD[:, t] predicts
            tokens_RT[:, t]).
        tokens_RT: int32 token ids.
        temps_RT: sampling temperature of each token (0 means greedy: scored at 1).
        chunk_size: positions per logits block at least (`head_chunk`); T is padded up to a
            multiple of the block.

    Returns:
        (logp_RT, entropy_RT), float32.
    """
    w_VD, dtype = model.head_weight(), _compute_dtype(model)
    n, t, d = h_RTD.shape
    c = head_chunk(n, t, chunk_size, model.cfg.layout.head_chunk_rows)
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        h_RTD = jnp.pad(h_RTD, ((0, 0), (0, pad), (0, 0)))
        tokens_RT = jnp.pad(tokens_RT, ((0, 0), (0, pad)))
        temps_RT = jnp.pad(temps_RT, ((0, 0), (0, pad)), constant_values=1.0)
    temps_RT = jnp.where(temps_RT > 0, temps_RT, 1.0).astype(jnp.float32)

    def split(x):
        return jnp.swapaxes(x.reshape((n, n_chunks, c) + x.shape[2:]), 0, 1)

    keep = n * n_chunks * c * w_VD.shape[0] * 4 <= KEEP_LOG_PROBS_BYTES

    def stats(_, xs):
        h_RCD, tokens_RC, temps_RC = xs
        return None, _head_stats(h_RCD, w_VD, tokens_RC, temps_RC, dtype, keep)

    _, (logp, ent) = jax.lax.scan(stats, None, (split(h_RTD), split(tokens_RT), split(temps_RT)))

    def merge(x):
        return jnp.swapaxes(x, 0, 1).reshape(n, n_chunks * c)[:, :t]

    return merge(logp), merge(ent)


def _compute_dtype(model: Any):
    return jnp.dtype(getattr(model.cfg, "dtype", "float32"))
