"""The decoder: one module for Llama, SmolLM2, Qwen2/2.5 and Qwen3, parametrised by ModelConfig.

Layers are stored stacked on a leading L axis (one `block.Block` whose weights are [L, ...]) and run
with `jax.lax.scan`, so a 30-layer model compiles in about the time of a 2-layer one. Inside the
scan body each layer's weight slice is merged back into a `Block` (`nnx.merge`), which keeps the
per-layer code ordinary module code. The layout's `layer_loop="unroll"` unrolls the scan
instead (longer compile, no stacked residual/gradient buffers in the backward pass).

Three entry points, one per use: `forward` / `forward_segments` (training and scoring, no
cache; several segments, later ones attending earlier ones' keys and values, in one scan),
`prefill` (the sampler's prompt pass into a `KVCache`,
carried whole through the scan and updated in place at (layer, slot)) and `decode_step` (the
sampler's one-token steps on the decode layout of `jaxgrpo.models.decode` and a
`LayerKVCache`). Every layer runs the one body `layers.decoder_layer`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx, shard_act
from jaxgrpo.models.accumulate import scan_adding_gradients
from jaxgrpo.models.block import Block
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.decode import (
    DecodeLayer,
    decode_layer,
    decode_layer_from_block,
    shard_decode_layer,
)
from jaxgrpo.models.kv_cache import KVCache, LayerKVCache
from jaxgrpo.models.layers import (
    PROJECTION_OUTPUTS,
    X_AXES,
    BandedMask,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxgrpo.models.lora import merge as merge_lora

# remat_policy="projections": the layer's named projection outputs stay for the backward pass.
_KEEP_PROJECTIONS = jax.checkpoint_policies.save_only_these_names(*PROJECTION_OUTPUTS)


class Transformer(nnx.Module):
    """Decoder-only LM. `model(ids_BT, attention_mask=mask_BT) -> logits_BTV` (float32).

    Attributes:
        cfg: the ModelConfig.
        shard_ctx: mesh + rules used to constrain activations, or None (set by
            `jaxgrpo.models.construct.random_model`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        emb = jax.random.normal(rngs.params(), (v, d), jnp.float32) * 0.02
        self.embed = nnx.Param(emb.astype(cfg.param_dtype), logical_axes=("vocab", "embed"))
        self.layers = Block(cfg, stack=(cfg.num_layers,), rngs=rngs)
        self.final_norm = RMSNorm(d, "embed", cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        # The head is stored [V, D] like the embedding it may be tied to: an [in, out] copy
        # for the decode loop would cost a vocabulary-sized matrix more (benchmarks/README.md,
        # "The LM head stored [V, D]").
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Param(
                (jax.random.normal(rngs.params(), (v, d), jnp.float32) * 0.02).astype(
                    cfg.param_dtype
                ),
                logical_axes=("vocab", "embed"),
            )
        )
        self.shard_ctx: ShardingCtx | None = None

    def __call__(self, input_ids_BT: Array, attention_mask: Array | None = None) -> Array:
        return self.logits(self.forward(input_ids_BT, attention_mask))

    def head_weight(self) -> Array:
        """The LM head's weight [V, D] (the embedding when they are tied)."""
        return (self.embed if self.lm_head is None else self.lm_head)[...]

    def logits(self, h_BTD: Array) -> Array:
        """LM head: [B, T, D] -> float32 logits [B, T, V]."""
        w_VD = self.head_weight()
        logits_BTV = jnp.einsum(
            "BTD,VD->BTV",
            h_BTD.astype(self.cfg.dtype),
            w_VD.astype(self.cfg.dtype),
            preferred_element_type=jnp.float32,
        )
        return shard_act(logits_BTV, ("act_batch", "act_length", "act_vocab"), self.shard_ctx)

    def forward(
        self,
        ids_BT: Array,
        mask_BT: Array | None = None,
        positions_BT: Array | None = None,
        attention_BTS: Array | None = None,
    ) -> Array:
        """Final-normed hidden states of a pass without a cache (training and scoring).

        Args:
            ids_BT: int token ids [B, T].
            mask_BT: 1 for real tokens, 0 for (left) padding; default all ones.
            positions_BT: position ids; default `cumsum(mask) - 1`, clipped at 0.
            attention_BTS: bool [B, T, T]: which keys each query attends, replacing the
                causal mask over real tokens (e.g. packed sequences).

        Returns:
            h_BTD in the compute dtype.
        """
        return self.forward_segments([Segment(ids_BT, mask_BT, positions_BT, attention_BTS)])[0]

    def forward_segments(
        self, segments: Sequence[Segment], layer_grad_acc: nnx.State | None = None
    ) -> list[Array]:
        """Several token segments through one scan over the layers, without a cache.

        Segment j attends, at every layer, the keys and values that layer computed for the
        segments in its ``prefix`` (in that order), then its own; they are never stored across
        layers. This is how the scoring passes share prompts: a batch's common prefix, each
        prompt's own tokens attending it, then the completions attending both, as three
        segments. One scan (not one per segment) means one gradient accumulator per weight in
        the backward pass, and with remat one saved input per layer and segment (plus, with
        remat_policy "projections", the layer's projection outputs).

        `layer_grad_acc` (the stacked layers' state, e.g. a gradient accumulator) is added
        into the layers' gradient in place as the backward pass produces it
        (`jaxgrpo.models.accumulate.scan_adding_gradients`); every weight of the layers must
        then be differentiated, and this pass must be the only use of them.

        Returns:
            Each segment's final-normed hidden states [B_j, T_j, D] in the compute dtype.

        Raises:
            ValueError: a segment attends a later one, or has a prefix but no positions and
                attention mask, or a mask of the wrong shape.
        """
        inputs = [self._segment_inputs(j, seg, segments) for j, seg in enumerate(segments)]
        needs_kv = {i for seg in segments for i in seg.prefix}
        graphdef, state = nnx.split(self.layers)
        ctx = self.shard_ctx

        def body(xs, layer_state):
            block = nnx.merge(graphdef, layer_state)
            kvs, out = {}, []
            for j, (seg, x_BTD, (_, cos, sin, mask)) in enumerate(
                zip(segments, xs, inputs, strict=True)
            ):
                prefix = None
                if seg.prefix:
                    parts = [_rows_as(kvs[i], x_BTD.shape[0]) for i in seg.prefix]
                    prefix = tuple(jnp.concatenate(kv, axis=1) for kv in zip(*parts, strict=True))
                x_BTD, kvs[j] = block(
                    x_BTD, cos, sin, mask, prefix_kv=prefix, emit_kv=j in needs_kv, ctx=ctx
                )
                out.append(x_BTD)
            return tuple(out)

        unroll = self.cfg.num_layers if self.cfg.layout.unrolls_layers else 1
        init = tuple(x[0] for x in inputs)
        remat = self.cfg.remat
        if remat and self.cfg.remat_policy == "projections":
            # Its residuals are the block's input and the named outputs (and, in the in-place
            # gradient scan, what the body closes over, once per layer); the loop keeps them.
            body, remat = jax.checkpoint(body, policy=_KEEP_PROJECTIONS), False
        if layer_grad_acc is None:
            step = jax.checkpoint(body) if remat else body
            xs, _ = jax.lax.scan(lambda c, x: (step(c, x), None), init, state, unroll=unroll)
        else:
            xs = scan_adding_gradients(
                body, init, state, layer_grad_acc, unroll=unroll, remat=remat
            )
        return [self.final_norm(x_BTD) for x_BTD in xs]

    def _segment_inputs(self, j: int, seg: Segment, segments: Sequence[Segment]) -> tuple:
        """(embeddings, cos, sin, attention mask) of segment j, checked against its prefix."""
        b, t = seg.ids_BT.shape
        if any(not 0 <= i < j for i in seg.prefix):
            raise ValueError(f"segment {j} may attend only earlier segments, not {seg.prefix}")
        if seg.prefix and (seg.positions_BT is None or seg.attention_BTS is None):
            raise ValueError(f"segment {j} has a prefix: it needs positions_BT and attention_BTS")
        mask_BT = jnp.ones((b, t), jnp.bool_) if seg.mask_BT is None else seg.mask_BT != 0
        positions = seg.positions_BT
        if positions is None:
            positions = _positions(jnp.zeros((b, 1), jnp.int32), mask_BT)
        x_BTD, cos, sin = self._embed(seg.ids_BT, positions)
        attention = seg.attention_BTS
        s = t + sum(segments[i].ids_BT.shape[1] for i in seg.prefix)
        if attention is None:
            attention = _causal(mask_BT, jnp.arange(t))
        elif isinstance(attention, BandedMask):
            w, keys = attention.width, (attention.back + 1) * attention.width
            if not seg.prefix or t % w or attention.own_XWV.shape != (b * t // w, w, keys):
                raise ValueError(f"a BandedMask of width {w} needs a prefix and T = {t} blocks")
        elif attention.shape != (b, t, s):
            raise ValueError(f"attention_BTS has shape {attention.shape}, want {(b, t, s)}")
        else:
            attention = attention.astype(jnp.bool_)
        return x_BTD, cos, sin, attention

    def prefill(self, ids_BT: Array, mask_BT: Array, cache: KVCache) -> tuple[Array, KVCache]:
        """The sampler's prompt pass: writes the T tokens' keys and values into `cache` at
        slots [cache.index, cache.index + T); attention covers the whole cache.

        Args:
            ids_BT: int token ids [B, T], left-padded.
            mask_BT: 1 for real tokens, 0 for padding.
            cache: the stacked cache to extend.

        Returns:
            (h_BTD in the compute dtype, the extended cache).
        """
        return self._cached(ids_BT, mask_BT, cache, self._run_layers)

    def decode_step(
        self,
        ids_BT: Array,
        mask_BT: Array,
        cache: LayerKVCache,
        layers: Sequence[DecodeLayer] | DecodeLayer,
    ) -> tuple[Array, LayerKVCache]:
        """The sampler's decode step: `prefill` on the decode layout (`decode_layers()`, one
        after the other or scanned when stacked) and its `LayerKVCache`."""
        if isinstance(layers, DecodeLayer) != cache.stacked:
            raise TypeError("stacked decode layers go with a stacked LayerKVCache")
        run = functools.partial(self._run_decode_layers, layers)
        return self._cached(ids_BT, mask_BT, cache, run)

    def _embed(self, ids_BT: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
        """The token embeddings [B, T, D] and the RoPE tables of their positions."""
        cos, sin = rope_cos_sin(positions_BT, rope_inv_freq(self.cfg))
        x_BTD = jnp.take(self.embed[...], ids_BT, axis=0).astype(self.cfg.dtype)
        return shard_act(x_BTD, X_AXES, self.shard_ctx), cos, sin

    def _cached(self, ids_BT, mask_BT, cache, run_layers):
        """`prefill` and `decode_step`: positions after the cache's, attention over it, and
        the cache advanced by T slots."""
        t = ids_BT.shape[1]
        mask_BT = mask_BT != 0
        x_BTD, cos, sin = self._embed(ids_BT, _positions(cache.next_pos[:, None], mask_BT))
        key_mask_BS = jax.lax.dynamic_update_slice(cache.mask, mask_BT, (0, cache.index))
        mask_BTS = _causal(key_mask_BS, cache.index + jnp.arange(t))
        x_BTD, (k, v) = run_layers(x_BTD, cos, sin, mask_BTS, cache)
        cache = cache.replace(
            k=k,
            v=v,
            mask=key_mask_BS,
            next_pos=cache.next_pos + jnp.sum(mask_BT, axis=1, dtype=jnp.int32),
            index=cache.index + t,
        )
        return self.final_norm(x_BTD), cache

    @property
    def scans_decode(self) -> bool:
        """Whether the sampler's decode steps scan stacked layers (`Layout.decode_loop`)."""
        return self.cfg.layout.scans_decode

    def decode_layers(self) -> list[DecodeLayer] | DecodeLayer:
        """The L layers in the decode layout: adapters folded in, matrices [in, out].

        L separate `DecodeLayer`s for the unrolled decode loop, or one whose arrays are
        stacked [L, ...] when `scans_decode`. Called once per `generate` call, outside the
        decode loop, so the loop's steps read every weight in place (see
        `jaxgrpo.models.decode`). The model is not modified.
        """
        graphdef, state = nnx.split(self.layers)
        dtype = jnp.dtype(self.cfg.dtype)

        def convert(layer_state):
            block = merge_lora(nnx.merge(graphdef, layer_state))
            return decode_layer_from_block(block, self.cfg.rms_norm_eps, dtype)

        shard = lambda w: shard_decode_layer(w, self.shard_ctx, self.cfg.num_kv_heads)  # noqa: E731
        if self.scans_decode:
            return shard(jax.vmap(convert)(state))
        return [
            shard(convert(jax.tree.map(lambda x, i=i: x[i], state)))
            for i in range(self.cfg.num_layers)
        ]

    def _run_decode_layers(self, layers, x_BTD, cos, sin, mask_BTS, cache: LayerKVCache):
        """The layers of `decode_step`: a scan over stacked `DecodeLayer`s carrying the
        stacked cache, or an unrolled loop over per-layer ones."""
        step = functools.partial(
            decode_layer, cos=cos, sin=sin, mask_BTS=mask_BTS, index=cache.index,
            prompt_mask=cache.prompt_mask, ctx=self.shard_ctx,
        )  # fmt: skip
        if cache.stacked:

            def body(carry, xs):
                x_BTD, kv = carry
                w, pk, pv, i = xs
                return step(w, x_BTD, kv=kv, prompt_kv=(pk, pv), layer=i), None

            xs = (layers, cache.prompt_k, cache.prompt_v, jnp.arange(self.cfg.num_layers))
            (x_BTD, kv), _ = jax.lax.scan(body, (x_BTD, (cache.k, cache.v)), xs)
            return x_BTD, kv
        ks, vs = [], []
        prompt_kv = zip(cache.prompt_k, cache.prompt_v, strict=True)
        for w, k, v, pkv in zip(layers, cache.k, cache.v, prompt_kv, strict=True):
            x_BTD, (k, v) = step(w, x_BTD, kv=(k, v), prompt_kv=pkv)
            ks.append(k)
            vs.append(v)
        return x_BTD, (tuple(ks), tuple(vs))

    def _run_layers(self, x_BTD, cos, sin, mask_BTS, cache: KVCache):
        """`prefill`'s layers: scans (or unrolls) the stacked Block over L, carrying x and the
        whole cache, each layer writing its keys and values at (layer, slot)."""
        graphdef, state = nnx.split(self.layers)
        ctx = self.shard_ctx

        def body(carry, xs):
            x_BTD, kv = carry
            layer_state, layer = xs
            block = nnx.merge(graphdef, layer_state)
            x_BTD, kv = block(
                x_BTD, cos, sin, mask_BTS, kv=kv, layer=layer, index=cache.index, ctx=ctx
            )
            return (x_BTD, kv), None

        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        unroll = self.cfg.num_layers if self.cfg.layout.unrolls_layers else 1
        (x_BTD, kv), _ = jax.lax.scan(
            body, (x_BTD, (cache.k, cache.v)), (state, layers), unroll=unroll
        )
        return x_BTD, kv


class Segment(NamedTuple):
    """Tokens of one `Transformer.forward_segments` segment.

    Attributes:
        ids_BT: int token ids [B, T].
        mask_BT: 1 for real tokens, 0 for padding; None = all real.
        positions_BT: position ids; None = `cumsum(mask) - 1` (needed with a prefix).
        attention_BTS: None (causal over real tokens), a bool [B, T, S] mask over the prefix's
            S - T slots then the segment's own T, or a `layers.BandedMask` (packed rows whose
            blocks attend the prefix and two key blocks). Needed with a prefix.
        prefix: indices of earlier segments whose keys and values this one attends, in slot
            order. A prefix segment of one row is broadcast to every row; one of B rows serves
            this segment's B x G rows in groups of G (row r attends prefix row r // G).
    """

    ids_BT: Array
    mask_BT: Array | None = None
    positions_BT: Array | None = None
    attention_BTS: Array | BandedMask | None = None
    prefix: tuple[int, ...] = ()


def _rows_as(kv: tuple[Array, Array], rows: int) -> tuple[Array, Array]:
    """A prefix segment's keys and values [b, S, K, H] for a segment of `rows` rows."""
    b = kv[0].shape[0]
    if b == rows:
        return kv
    if b == 1:
        return tuple(jnp.broadcast_to(x, (rows,) + x.shape[1:]) for x in kv)
    return tuple(jnp.repeat(x, rows // b, axis=0) for x in kv)


def _positions(offset_B1: Array, mask_BT: Array) -> Array:
    """Position ids `offset + cumsum(mask) - 1`, clipped at 0 (left padding gets 0)."""
    return jnp.maximum(offset_B1 + jnp.cumsum(mask_BT, axis=1) - 1, 0)


def _causal(key_mask_BS: Array, q_pos_T: Array) -> Array:
    """[B, T, S]: query t (at slot q_pos_T[t]) attends real keys at slots up to its own."""
    s = key_mask_BS.shape[1]
    causal_TS = jnp.arange(s)[None, :] <= q_pos_T[:, None]
    return key_mask_BS[:, None, :] & causal_TS[None, :, :]


def layer_block(model: Transformer, i: int) -> Block:
    """Layer i of the stacked decoder as an ordinary (unstacked) Block, e.g. for tests."""
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))
