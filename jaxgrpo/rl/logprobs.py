"""Per-token log-probabilities and entropies of sampled completions, with prefix sharing.

The scoring passes of a GRPO step (reference, old policy, and the loss itself) need, for every
completion token, `log softmax(logits / temperature)` at that token, under the temperature the
sampler used for it. Two costs dominate on every backend and this module avoids both:

* Logits. A full `[B, S, V]` float32 logit tensor is the largest array of a step (Qwen's V is
  152k). Logits are computed only at the T positions that predict completion tokens, and in
  chunks of `chunk_size` positions whose hand-written VJP (`_head_stats`) recomputes each
  chunk's `[N, C, V]` block instead of storing all of them, unless all of them together take
  at most `KEEP_LOG_PROBS_BYTES` (then the backward pass reads them and skips a matmul).
* Shared prompts. The G samples of a group have the same prompt, which is usually most of the
  tokens. `shared_prefix_logprobs` runs the prompt once per group, keeping each layer's keys
  and values (`hidden(return_kv=True)`), and runs only the completions, each layer attending
  the prompt's keys and values before its own (`hidden(prefix_kv=...)`). Those keys and values
  are ordinary differentiable values, so gradients from all G completions flow back into the
  prompt pass and sum there: the LoRA (or full) gradients are those of the unshared
  computation, which `full_sequence_logprobs` implements and the tests compare against.
  (The prompt's keys are read per layer, not written into a cache: in a full fine-tuning
  update, autodiff of a stacked cache that the completion pass extends copied the whole cache
  at every layer, and the prompt pass attended the empty completion slots too.)
  One level up, the prompts of a batch usually begin alike (a system prompt, worked
  examples): with `shared_ids` those tokens run once for the whole batch and the prompts'
  own tokens attend their keys and values (`jaxgrpo.rl.rollout.split_common_prefix`).

* Padding. Completions of one group differ in length, and padding every one to the longest
  scores mostly padding once a policy answers briefly. With a `Packing`
  (`jaxgrpo.rl.rollout.pack`), a group's completions run end to end in one row against the
  group's prompt cache, each attending only to the prompt and to its own earlier tokens, with
  its own positions: the values and gradients are again those of the unshared computation.

Temperature 0 (greedy) rows are scored at temperature 1, matching the sampler's convention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.rl.rollout import Packing
from jaxgrpo.types import Array, PyTree

# Up to this many bytes of [N, T, V] float32 log-probabilities, the backward pass of the
# head keeps them instead of recomputing the logits (the GRPO benchmark's 512 packed
# positions x SmolLM2's 49,152 tokens: 100 MB held, a [512, 576] x [576, 49152] matmul saved).
KEEP_LOG_PROBS_BYTES = 256 << 20


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_stats(
    h_NCD: Array, w_VD: Array, tokens_NC: Array, temps_NC: Array, dtype: Any, keep: bool
) -> tuple[Array, Array]:
    """Log-prob of `tokens_NC` and entropy under `softmax(h @ w.T / temperature)`.

    The backward pass is written by hand. Autodiff of the log-softmax keeps several [N, C, V]
    intermediates and walks them more often than needed; this backward forms
    d(loss)/d(logits) in one fused pass,
    dlogp * (onehot - p) - dentropy * p * (log p + entropy), all over the temperature,
    from the [N, C, V] log-probabilities: kept from the forward pass when `keep`, else
    recomputed (one matmul, so nothing [N, C, V] is held between the passes).
    """
    return _head_stats_fwd(h_NCD, w_VD, tokens_NC, temps_NC, dtype, keep)[0]


def _head_logits(h_NCD, w_VD, dtype):
    return jnp.einsum(
        "NCD,VD->NCV", h_NCD.astype(dtype), w_VD.astype(dtype), preferred_element_type=jnp.float32
    )


def _head_stats_fwd(h_NCD, w_VD, tokens_NC, temps_NC, dtype, keep):
    z_NCV = _head_logits(h_NCD, w_VD, dtype) / temps_NC[..., None]
    lse_NC = jax.nn.logsumexp(z_NCV, axis=-1)
    logp_NC = jnp.take_along_axis(z_NCV, tokens_NC[..., None], axis=-1)[..., 0] - lse_NC
    logq_NCV = z_NCV - lse_NC[..., None]
    entropy_NC = -jnp.sum(jnp.exp(logq_NCV) * logq_NCV, axis=-1)
    kept = logq_NCV if keep else lse_NC
    return (logp_NC, entropy_NC), (h_NCD, w_VD, tokens_NC, temps_NC, kept, entropy_NC)


def _head_stats_bwd(dtype, keep, residuals, cotangents):
    h_NCD, w_VD, tokens_NC, temps_NC, kept, entropy_NC = residuals
    dlogp_NC, dent_NC = cotangents
    if keep:
        logq_NCV = kept
    else:
        z_NCV = _head_logits(h_NCD, w_VD, dtype) / temps_NC[..., None]
        logq_NCV = z_NCV - kept[..., None]
    dz_NCV = -jnp.exp(logq_NCV) * (
        dlogp_NC[..., None] + dent_NC[..., None] * (logq_NCV + entropy_NC[..., None])
    )
    n, c = tokens_NC.shape
    dz_NCV = dz_NCV.at[jnp.arange(n)[:, None], jnp.arange(c)[None, :], tokens_NC].add(dlogp_NC)
    dz_NCV = (dz_NCV / temps_NC[..., None]).astype(dtype)
    dh_NCD = jnp.einsum(
        "NCV,VD->NCD", dz_NCV, w_VD.astype(dtype), preferred_element_type=jnp.float32
    )
    dw_VD = jnp.einsum(
        "NCV,NCD->VD", dz_NCV, h_NCD.astype(dtype), preferred_element_type=jnp.float32
    )
    return dh_NCD.astype(h_NCD.dtype), dw_VD.astype(w_VD.dtype), None, jnp.zeros_like(temps_NC)


_head_stats.defvjp(_head_stats_fwd, _head_stats_bwd)


def head_token_logprobs(
    model: Any, h_NTD: Array, tokens_NT: Array, temps_NT: Array, chunk_size: int = 64
) -> tuple[Array, Array]:
    """Scores `tokens_NT` from the hidden states that predict them, chunk by chunk over T.

    Logits come from the model's linear LM head (`model.head_weight()`), C positions at a time
    under a scan; `_head_stats` recomputes each chunk's [N, C, V] logits in the backward pass
    instead of keeping them.

    Args:
        model: a `Transformer` (or anything with `head_weight()` and `cfg.dtype`).
        h_NTD: hidden state at the position before each token (h_NTD[:, t] predicts
            tokens_NT[:, t]).
        tokens_NT: int32 token ids.
        temps_NT: sampling temperature of each token (0 means greedy: scored at 1).
        chunk_size: positions per logits block; T is padded up to a multiple of it.

    Returns:
        (logp_NT, entropy_NT), float32.
    """
    w_VD, dtype = model.head_weight(), _compute_dtype(model)
    n, t, d = h_NTD.shape
    c = max(1, min(chunk_size, t))
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        h_NTD = jnp.pad(h_NTD, ((0, 0), (0, pad), (0, 0)))
        tokens_NT = jnp.pad(tokens_NT, ((0, 0), (0, pad)))
        temps_NT = jnp.pad(temps_NT, ((0, 0), (0, pad)), constant_values=1.0)
    temps_NT = jnp.where(temps_NT > 0, temps_NT, 1.0).astype(jnp.float32)

    def split(x):
        return jnp.swapaxes(x.reshape((n, n_chunks, c) + x.shape[2:]), 0, 1)

    keep = n * n_chunks * c * w_VD.shape[0] * 4 <= KEEP_LOG_PROBS_BYTES

    def stats(_, xs):
        h_NCD, tokens_NC, temps_NC = xs
        return None, _head_stats(h_NCD, w_VD, tokens_NC, temps_NC, dtype, keep)

    _, (logp, ent) = jax.lax.scan(stats, None, (split(h_NTD), split(tokens_NT), split(temps_NT)))

    def merge(x):
        return jnp.swapaxes(x, 0, 1).reshape(n, n_chunks * c)[:, :t]

    return merge(logp), merge(ent)


def full_sequence_logprobs(
    model: Any,
    prompt_ids_NP: Array,
    prompt_mask_NP: Array,
    tokens_NT: Array,
    mask_NT: Array,
    temps_NT: Array,
    chunk_size: int = 64,
) -> tuple[Array, Array]:
    """Unshared scoring: one forward pass over each full (prompt + completion) row.

    Args:
        model: a `Transformer`.
        prompt_ids_NP: int32 left-padded prompts, one row per completion.
        prompt_mask_NP: prompt validity mask.
        tokens_NT: int32 completion tokens.
        mask_NT: completion validity mask (1 up to and including the stop token).
        temps_NT: sampling temperature of each completion token.
        chunk_size: positions per logits block.

    Returns:
        (logp_NT, entropy_NT), float32; values at masked positions are finite but meaningless.
    """
    p = prompt_ids_NP.shape[1]
    t = tokens_NT.shape[1]
    ids_NS = jnp.concatenate([prompt_ids_NP, tokens_NT], axis=1)
    mask_NS = jnp.concatenate([prompt_mask_NP, mask_NT], axis=1).astype(jnp.int32)
    h_NSD, _ = model.hidden(ids_NS, mask_NS)
    h_NTD = h_NSD[:, p - 1 : p + t - 1]
    return head_token_logprobs(model, h_NTD, tokens_NT, temps_NT, chunk_size)


def shared_prefix_logprobs(
    model: Any,
    prompt_ids_BP: Array,
    prompt_mask_BP: Array,
    tokens_NT: Array,
    mask_NT: Array,
    temps_NT: Array,
    *,
    group_size: int,
    chunk_size: int = 64,
    packing: Packing | None = None,
    shared_ids: Array | None = None,
) -> tuple[Array, Array]:
    """Prefix-shared scoring: each prompt runs once, its G completions against its KV cache.

    Equal to `full_sequence_logprobs` on the prompts repeated G times (row b*G + g is sample g
    of prompt b), in values and in gradients; with `shared_ids`, on those tokens followed by
    each prompt.

    Args:
        model: a `Transformer` (its `hidden` accepts a `KVCache`).
        prompt_ids_BP: int32 left-padded prompts, one per group.
        prompt_mask_BP: prompt validity mask.
        tokens_NT: int32 completion tokens, N = B * group_size, grouped by prompt.
        mask_NT: completion validity mask.
        temps_NT: sampling temperature of each completion token.
        group_size: G, completions per prompt.
        chunk_size: positions per logits block.
        packing: score each group's completions packed into one row (see `packed_logprobs`).
        shared_ids: int32 [1, C] tokens that precede every prompt, run once for the whole
            batch (`jaxgrpo.rl.rollout.split_common_prefix`); None or C = 0: none.

    Returns:
        (logp_NT, entropy_NT), float32.
    """
    if packing is not None:
        return packed_logprobs(
            model,
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_NT,
            temps_NT,
            packing,
            chunk_size,
            shared_ids,
        )
    n, t = tokens_NT.shape
    h_BPD, prompt_kv, slots_BS, next_pos_B = _prompt_pass(
        model, prompt_ids_BP, prompt_mask_BP, shared_ids
    )
    # Left padding puts every prompt's last token in the last column.
    h_last_ND = jnp.repeat(h_BPD[:, -1], group_size, axis=0)
    if t > 1:
        rep = lambda x, axis: jnp.repeat(x, group_size, axis=axis)  # noqa: E731
        own_mask_Nt = mask_NT[:, :-1] != 0
        causal_tt = jnp.tril(jnp.ones((t - 1, t - 1), jnp.bool_))
        prompt_NtS = jnp.broadcast_to(rep(slots_BS, 0)[:, None, :], (n, t - 1, slots_BS.shape[1]))
        own_Ntt = causal_tt[None] & own_mask_Nt[:, None, :]
        positions_Nt = rep(next_pos_B, 0)[:, None] + jnp.cumsum(own_mask_Nt, axis=1) - 1
        h_NtD, _ = model.hidden(
            tokens_NT[:, :-1],
            own_mask_Nt.astype(jnp.int32),
            positions_BT=jnp.maximum(positions_Nt, 0),
            prefix_kv=(rep(prompt_kv[0], 1), rep(prompt_kv[1], 1)),
            attention_BTS=jnp.concatenate([prompt_NtS, own_Ntt], axis=2),
        )
        h_NTD = jnp.concatenate([h_last_ND[:, None], h_NtD], axis=1)
    else:
        h_NTD = h_last_ND[:, None]
    return head_token_logprobs(model, h_NTD, tokens_NT, temps_NT, chunk_size)


def packed_logprobs(
    model: Any,
    prompt_ids_BP: Array,
    prompt_mask_BP: Array,
    tokens_NT: Array,
    temps_NT: Array,
    packing: Packing,
    chunk_size: int = 64,
    shared_ids: Array | None = None,
) -> tuple[Array, Array]:
    """Prefix-shared scoring with each group's completions packed end to end in one row.

    The prompt runs once; the packed row [B, L] attends its keys and values, with positions
    restarting at each completion's start and a mask that lets a token see the
    prompt and the earlier tokens of its own completion only. The first token of a completion
    is predicted by the prompt's last hidden state, every other one by the packed column
    before it. Columns past a completion's end (per `packing`) come back as 0.

    Args: as `shared_prefix_logprobs`, with `packing` from `jaxgrpo.rl.rollout.pack`.

    Returns:
        (logp_NT, entropy_NT), float32.
    """
    b = prompt_ids_BP.shape[0]
    n, t = tokens_NT.shape
    width = packing.src_BL.shape[1]
    h_BPD, prompt_kv, slots_BS, next_pos_B = _prompt_pass(
        model, prompt_ids_BP, prompt_mask_BP, shared_ids
    )

    def to_packed(x_NT):
        return jnp.take_along_axis(x_NT.reshape(b, n // b * t), packing.src_BL, axis=1)

    ids_BL, temps_BL = to_packed(tokens_NT), to_packed(temps_NT)
    seg_BL, pos_BL = packing.seg_BL, packing.pos_BL
    valid_BL = seg_BL >= 0
    causal_LL = jnp.tril(jnp.ones((width, width), jnp.bool_))
    own_BLL = (seg_BL[:, :, None] == seg_BL[:, None, :]) & causal_LL[None] & valid_BL[:, None, :]
    prompt_BLS = jnp.broadcast_to(slots_BS[:, None, :], (b, width, slots_BS.shape[1]))
    h_BLD, _ = model.hidden(
        ids_BL,
        valid_BL.astype(jnp.int32),
        positions_BT=next_pos_B[:, None] + pos_BL,
        prefix_kv=prompt_kv,
        attention_BTS=jnp.concatenate([prompt_BLS, own_BLL], axis=2),
    )
    # Left padding puts every prompt's last token in the last column.
    h_prev_BLD = jnp.concatenate([h_BPD[:, -1:], h_BLD[:, :-1]], axis=1)
    h_pred_BLD = jnp.where((pos_BL == 0)[..., None], h_BPD[:, -1:], h_prev_BLD)
    stats = head_token_logprobs(model, h_pred_BLD, ids_BL, temps_BL, chunk_size)

    def to_rows(x_BL):
        x_BL1 = jnp.concatenate([x_BL, jnp.zeros((b, 1), x_BL.dtype)], axis=1)
        unpack = packing.unpack_NT.reshape(b, n // b * t)
        return jnp.take_along_axis(x_BL1, unpack, axis=1).reshape(n, t)

    return to_rows(stats[0]), to_rows(stats[1])


def _prompt_pass(model: Any, prompt_ids_BP: Array, prompt_mask_BP: Array, shared_1C=None):
    """Runs the prompts: their hidden states, keys and values, and what the completions need.

    With `shared_1C` (C > 0 tokens every prompt begins with, see
    `jaxgrpo.rl.rollout.split_common_prefix`), that prefix runs once as one row and the
    [B, P] prompts are what follows it: they attend its keys and values, which are broadcast
    to every prompt (so their gradients sum over the prompts, as in the unshared pass).

    Returns:
        (h_BPD, the stacked keys and values [L, B, S, K, H] of the S = C + P prompt slots,
        which of those slots hold tokens [B, S], the position id of each prompt's first
        completion token [B]).
    """
    mask_BP = prompt_mask_BP.astype(jnp.int32)
    valid_BP = mask_BP != 0
    c = 0 if shared_1C is None else shared_1C.shape[1]
    if c == 0:
        h_BPD, kv = model.hidden(prompt_ids_BP, mask_BP, return_kv=True)
        return h_BPD, kv, valid_BP, jnp.sum(mask_BP, axis=1, dtype=jnp.int32)
    b, p = prompt_ids_BP.shape
    _, shared_kv = model.hidden(shared_1C, return_kv=True)
    wide_kv = tuple(jnp.broadcast_to(x, (x.shape[0], b) + x.shape[2:]) for x in shared_kv)
    own_BPP = jnp.tril(jnp.ones((p, p), jnp.bool_))[None] & valid_BP[:, None, :]
    h_BPD, own_kv = model.hidden(
        prompt_ids_BP,
        mask_BP,
        positions_BT=c + jnp.maximum(jnp.cumsum(mask_BP, axis=1) - 1, 0),
        prefix_kv=wide_kv,
        attention_BTS=jnp.concatenate([jnp.ones((b, p, c), jnp.bool_), own_BPP], axis=2),
        return_kv=True,
    )
    kv = tuple(jnp.concatenate(pair, axis=2) for pair in zip(wide_kv, own_kv, strict=True))
    slots_BS = jnp.concatenate([jnp.ones((b, c), jnp.bool_), valid_BP], axis=1)
    return h_BPD, kv, slots_BS, c + jnp.sum(mask_BP, axis=1, dtype=jnp.int32)


def _compute_dtype(model: Any):
    return jnp.dtype(getattr(model.cfg, "dtype", "float32"))


def make_logprobs_fn(
    graphdef: Any,
    *,
    group_size: int,
    chunk_size: int = 64,
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> Callable[[PyTree, PyTree, Array, Array, Array, Array, Array], tuple[Array, Array]]:
    """Jitted prefix-shared scoring over split model state (reference and old-policy passes).

    Args:
        graphdef: the model's graph definition from `nnx.split(model, trainable, frozen)`;
            closed over, never traced.
        group_size: G.
        chunk_size: positions per logits block.
        in_shardings: optional shardings for (trainable, frozen, prompt ids, prompt mask,
            tokens, mask, temperatures).
        out_shardings: optional shardings for (logp, entropy).

    Returns:
        `fn(trainable, frozen, prompt_ids_BP, prompt_mask_BP, tokens_NT, mask_NT, temps_NT,
        packing=None, shared_ids=None) -> (logp_NT, entropy_NT)`.
    """

    def fn(
        trainable,
        frozen,
        prompt_ids_BP,
        prompt_mask_BP,
        tokens_NT,
        mask_NT,
        temps_NT,
        packing=None,
        shared_ids=None,
    ):
        model = nnx.merge(graphdef, trainable, frozen)
        return shared_prefix_logprobs(
            model,
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_NT,
            mask_NT,
            temps_NT,
            group_size=group_size,
            chunk_size=chunk_size,
            packing=packing,
            shared_ids=shared_ids,
        )

    kwargs = {}
    if in_shardings is not None:
        kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        kwargs["out_shardings"] = out_shardings
    return jax.jit(fn, **kwargs)
