"""Per-token log-probabilities and entropies of sampled completions, with prefix sharing.

The scoring passes of a GRPO step (reference, old policy, and the loss itself) need, for every
completion token, `log softmax(logits / temperature)` at that token, under the temperature the
sampler used for it. Two costs dominate on every backend and this module avoids both:

* Logits. A full `[B, S, V]` float32 logit tensor is the largest array of a step (Qwen's V is
  152k). Logits are computed only at the T positions that predict completion tokens, chunk by
  chunk (`jaxgrpo.models.lm_head.head_token_logprobs`).
* Shared prompts. The G samples of a group have the same prompt, which is usually most of the
  tokens. `shared_prefix_logprobs` runs the prompt once per group and the completions after
  it, as segments of one pass (`Transformer.forward_segments`): at every layer the completions
  attend the keys and values that layer computed for the prompt, before their own. Those keys
  and values are ordinary differentiable values, so gradients from all G completions flow back
  into the prompt and sum there: the LoRA (or full) gradients are those of the unshared
  computation, which `full_sequence_logprobs` implements and the tests compare against. One
  scan over the layers for all segments keeps one gradient accumulator per weight (separate
  passes kept one each, then added them: two full copies of the gradients more in a full
  fine-tuning update). One level up, the prompts of a batch usually begin alike (a system
  prompt, worked examples): with `shared_ids` those tokens are a first segment of one row,
  which the prompts' own tokens attend (`jaxgrpo.rl.rollout.split_common_prefix`).

* Padding. Completions of one group differ in length, and padding every one to the longest
  scores mostly padding once a policy answers briefly. With a `Packing`
  (`jaxgrpo.models.packing.pack`), a group's completions run end to end in one row against the
  group's prompt cache, each attending only to the prompt and to its own earlier tokens, with
  its own positions: the values and gradients are again those of the unshared computation.

Temperature 0 (greedy) rows are scored at temperature 1, matching the sampler's convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.models.layers import banded_mask
from jaxgrpo.models.lm_head import head_token_logprobs
from jaxgrpo.models.packing import Packing
from jaxgrpo.models.transformer import Segment


def full_sequence_logprobs(
    model: Any,
    prompt_ids_RP: Array,
    prompt_mask_RP: Array,
    tokens_RT: Array,
    mask_RT: Array,
    temps_RT: Array,
    chunk_size: int = 64,
) -> tuple[Array, Array]:
    """Unshared scoring: one forward pass over each full (prompt + completion) row.

    Args:
        model: a `Transformer`.
        prompt_ids_RP: int32 left-padded prompts, one row per completion.
        prompt_mask_RP: prompt validity mask.
        tokens_RT: int32 completion tokens.
        mask_RT: completion validity mask (1 up to and including the stop token).
        temps_RT: sampling temperature of each completion token.
        chunk_size: positions per logits block.

    Returns:
        (logp_RT, entropy_RT), float32; values at masked positions are finite but meaningless.
    """
    p = prompt_ids_RP.shape[1]
    t = tokens_RT.shape[1]
    ids_RS = jnp.concatenate([prompt_ids_RP, tokens_RT], axis=1)
    mask_RS = jnp.concatenate([prompt_mask_RP, mask_RT], axis=1).astype(jnp.int32)
    h_RSD = model.forward(ids_RS, mask_RS)
    h_RTD = h_RSD[:, p - 1 : p + t - 1]
    return head_token_logprobs(model, h_RTD, tokens_RT, temps_RT, chunk_size)


def shared_prefix_logprobs(
    model: Any,
    prompt_ids_BP: Array,
    prompt_mask_BP: Array,
    tokens_RT: Array,
    mask_RT: Array,
    temps_RT: Array,
    *,
    group_size: int,
    chunk_size: int = 64,
    packing: Packing | None = None,
    shared_ids: Array | None = None,
    layer_grad_acc: Any = None,
) -> tuple[Array, Array]:
    """Prefix-shared scoring: each prompt runs once, its G completions against its KV cache.

    Equal to `full_sequence_logprobs` on the prompts repeated G times (row b*G + g is sample g
    of prompt b), in values and in gradients; with `shared_ids`, on those tokens followed by
    each prompt.

    Args:
        model: a `Transformer` (`forward_segments`).
        prompt_ids_BP: int32 left-padded prompts, one per group.
        prompt_mask_BP: prompt validity mask.
        tokens_RT: int32 completion tokens, R = B * group_size, grouped by prompt.
        mask_RT: completion validity mask.
        temps_RT: sampling temperature of each completion token.
        group_size: G, completions per prompt.
        chunk_size: positions per logits block.
        packing: score each group's completions packed into one row (see `packed_logprobs`).
        shared_ids: int32 [1, C] tokens that precede every prompt, run once for the whole
            batch (`jaxgrpo.rl.rollout.split_common_prefix`); None or C = 0: none.
        layer_grad_acc: added into the layers' gradient as the backward pass produces it
            (`Transformer.forward_segments`).

    Returns:
        (logp_RT, entropy_RT), float32.
    """
    if packing is not None:
        return packed_logprobs(
            model,
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_RT,
            temps_RT,
            packing,
            chunk_size,
            shared_ids,
            layer_grad_acc,
        )
    n, t = tokens_RT.shape
    segments, slots_BS, next_pos_B = _prompt_segments(prompt_ids_BP, prompt_mask_BP, shared_ids)
    if t > 1:
        rep = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
        own_mask_Rt = mask_RT[:, :-1] != 0
        causal_tt = jnp.tril(jnp.ones((t - 1, t - 1), jnp.bool_))
        prompt_RtS = jnp.broadcast_to(rep(slots_BS)[:, None, :], (n, t - 1, slots_BS.shape[1]))
        own_Rtt = causal_tt[None] & own_mask_Rt[:, None, :]
        positions_Rt = rep(next_pos_B)[:, None] + jnp.cumsum(own_mask_Rt, axis=1) - 1
        segments.append(
            Segment(
                tokens_RT[:, :-1],
                own_mask_Rt.astype(jnp.int32),
                jnp.maximum(positions_Rt, 0),
                jnp.concatenate([prompt_RtS, own_Rtt], axis=2),
                prefix=tuple(range(len(segments))),
            )
        )
    h = model.forward_segments(segments, layer_grad_acc)
    # Left padding puts every prompt's last token in the last column.
    h_last_RD = jnp.repeat(h[len(segments) - (2 if t > 1 else 1)][:, -1], group_size, axis=0)
    h_RTD = jnp.concatenate([h_last_RD[:, None], h[-1]], axis=1) if t > 1 else h_last_RD[:, None]
    return head_token_logprobs(model, h_RTD, tokens_RT, temps_RT, chunk_size)


def packed_logprobs(
    model: Any,
    prompt_ids_BP: Array,
    prompt_mask_BP: Array,
    tokens_RT: Array,
    temps_RT: Array,
    packing: Packing,
    chunk_size: int = 64,
    shared_ids: Array | None = None,
    layer_grad_acc: Any = None,
) -> tuple[Array, Array]:
    """Prefix-shared scoring with each group's completions packed end to end in one row.

    The prompt runs once; the packed row [B, L] attends its keys and values, with positions
    restarting at each completion's start and a mask that lets a token see the
    prompt and the earlier tokens of its own completion only. The first token of a completion
    is predicted by the prompt's last hidden state, every other one by the packed column
    before it. Columns past a completion's end (per `packing`) come back as 0.

    Args: as `shared_prefix_logprobs`, with `packing` from `jaxgrpo.models.packing.pack`.

    Returns:
        (logp_RT, entropy_RT), float32.
    """
    b = prompt_ids_BP.shape[0]
    n, t = tokens_RT.shape
    width = packing.src_BL.shape[1]
    segments, slots_BS, next_pos_B = _prompt_segments(prompt_ids_BP, prompt_mask_BP, shared_ids)

    def to_packed(x_RT):
        return jnp.take_along_axis(x_RT.reshape(b, n // b * t), packing.src_BL, axis=1)

    ids_BL, temps_BL = to_packed(tokens_RT), to_packed(temps_RT)
    seg_BL, pos_BL = packing.seg_BL, packing.pos_BL
    band, back = band_layout(t, width)
    if band:  # pad the row to whole blocks; the padding columns are cut off below
        extra = -width % band
        pad = lambda x, v=0: jnp.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
        ids_BC, seg_BC, pos_BC = pad(ids_BL), pad(seg_BL, -1), pad(pos_BL)
        attention = banded_mask(seg_BC, slots_BS, band, back)
    else:
        ids_BC, seg_BC, pos_BC = ids_BL, seg_BL, pos_BL
        attention = _dense_packed_mask(seg_BL, slots_BS)
    segments.append(
        Segment(
            ids_BC,
            (seg_BC >= 0).astype(jnp.int32),
            next_pos_B[:, None] + pos_BC,
            attention,
            prefix=tuple(range(len(segments))),
        )
    )
    h = model.forward_segments(segments, layer_grad_acc)
    h_BPD, h_BLD = h[-2], h[-1][:, :width]
    # Left padding puts every prompt's last token in the last column.
    h_prev_BLD = jnp.concatenate([h_BPD[:, -1:], h_BLD[:, :-1]], axis=1)
    h_pred_BLD = jnp.where((pos_BL == 0)[..., None], h_BPD[:, -1:], h_prev_BLD)
    stats = head_token_logprobs(model, h_pred_BLD, ids_BL, temps_BL, chunk_size)

    def to_rows(x_BL):
        x_BL1 = jnp.concatenate([x_BL, jnp.zeros((b, 1), x_BL.dtype)], axis=1)
        unpack = packing.unpack_NT.reshape(b, n // b * t)
        return jnp.take_along_axis(x_BL1, unpack, axis=1).reshape(n, t)

    return to_rows(stats[0]), to_rows(stats[1])


# Blocks of queries in the banded packed attention are at least this many columns wide: each
# block is one matmul of [W * M, H] x [H, P + (back + 1) W] per kv head, and narrower blocks
# would trade fewer masked keys for smaller, slower matmuls.
MIN_BAND = 128


def band_layout(t: int, width: int) -> tuple[int, int]:
    """(W, back) of the `layers.BandedMask` for packed rows of ``width`` columns holding
    completions of at most ``t`` tokens, or (0, 0) for the dense mask.

    With T2 the power of two >= t, blocks are W = max(T2 / 4, min(T2, MIN_BAND)) columns and
    attend the ``back`` = T2 / W blocks before their own: T2 + W keys per query beside the
    prompt's (2 T2 with blocks of T2, 1.6 T2 with blocks of T2 / 4). Dense when the row is no
    wider than one such window, where banding saves nothing.
    """
    t2 = 1 << max(t - 1, 0).bit_length()
    band = max(t2 // 4, min(t2, MIN_BAND))
    back = t2 // band
    return (band, back) if width > (back + 1) * band else (0, 0)


def _dense_packed_mask(seg_BL: Array, slots_BS: Array) -> Array:
    """bool [B, L, S + L]: every query attends the prompt's real slots, then the earlier
    columns of its own segment (``seg_BL``, -1 = padding) and itself."""
    b, width = seg_BL.shape
    causal_LL = jnp.tril(jnp.ones((width, width), jnp.bool_))
    own_BLL = (seg_BL[:, :, None] == seg_BL[:, None, :]) & causal_LL[None] & (seg_BL >= 0)[:, None]
    prompt_BLS = jnp.broadcast_to(slots_BS[:, None, :], (b, width, slots_BS.shape[1]))
    return jnp.concatenate([prompt_BLS, own_BLL], axis=2)


def _prompt_segments(prompt_ids_BP: Array, prompt_mask_BP: Array, shared_1C=None):
    """The prompts as `forward_segments` segments, and what the completions' segment needs.

    With `shared_1C` (C > 0 tokens every prompt begins with, see
    `jaxgrpo.rl.rollout.split_common_prefix`), that prefix is a segment of one row and the
    [B, P] prompts, what follows it, attend its keys and values at every layer (broadcast to
    every prompt, so their gradients sum over the prompts, as in the unshared pass).

    Returns:
        (segments: [shared, prompts] or [prompts], which of the S = C + P prompt slots hold
        tokens [B, S], the position id of each prompt's first completion token [B]).
    """
    mask_BP = prompt_mask_BP.astype(jnp.int32)
    valid_BP = mask_BP != 0
    c = 0 if shared_1C is None else shared_1C.shape[1]
    if c == 0:
        segment = Segment(prompt_ids_BP, mask_BP)
        return [segment], valid_BP, jnp.sum(mask_BP, axis=1, dtype=jnp.int32)
    b, p = prompt_ids_BP.shape
    own_BPP = jnp.tril(jnp.ones((p, p), jnp.bool_))[None] & valid_BP[:, None, :]
    prompts = Segment(
        prompt_ids_BP,
        mask_BP,
        c + jnp.maximum(jnp.cumsum(mask_BP, axis=1) - 1, 0),
        jnp.concatenate([jnp.ones((b, p, c), jnp.bool_), own_BPP], axis=2),
        prefix=(0,),
    )
    slots_BS = jnp.concatenate([jnp.ones((b, c), jnp.bool_), valid_BP], axis=1)
    return [Segment(shared_1C), prompts], slots_BS, c + jnp.sum(mask_BP, axis=1, dtype=jnp.int32)


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
        `fn(trainable, frozen, prompt_ids_BP, prompt_mask_BP, tokens_RT, mask_RT, temps_RT,
        packing=None, shared_ids=None) -> (logp_RT, entropy_RT)`.
    """

    def fn(
        trainable,
        frozen,
        prompt_ids_BP,
        prompt_mask_BP,
        tokens_RT,
        mask_RT,
        temps_RT,
        packing=None,
        shared_ids=None,
    ):
        model = nnx.merge(graphdef, trainable, frozen)
        return shared_prefix_logprobs(
            model,
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_RT,
            mask_RT,
            temps_RT,
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
