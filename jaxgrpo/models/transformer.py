"""The decoder: one module for Llama, SmolLM2, Qwen2/2.5 and Qwen3, parametrised by ModelConfig.

Layers are stored stacked on a leading L axis (one `Block` whose weights are [L, ...]) and run
with `jax.lax.scan`, so a 30-layer model compiles in about the time of a 2-layer one. Inside the
scan body each layer's weight slice is merged back into a `Block` (`nnx.merge`), which keeps the
per-layer code ordinary module code. `ModelConfig.unroll_layers` unrolls the scan instead
(longer compile, no stacked residual/gradient buffers in the backward pass).

The KV cache is carried whole through the scan and updated with `dynamic_update_slice` at
(layer, slot), which XLA performs in place: a decode step never copies the cache.

The sampler's one-token steps take another path (`decode_layers` + `LayerKVCache`, see
`jaxgrpo.models.decode`): separate per-layer weights and cache buffers, laid out for the
decode matmuls; prefill, training and scoring use the scan.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.decode import (
    DecodeLayer,
    decode_layer,
    decode_layer_from_block,
    shard_decode_layer,
)
from jaxgrpo.models.kv_cache import KVCache, LayerKVCache
from jaxgrpo.models.layers import (
    Einsum,
    RMSNorm,
    apply_rope,
    attend,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxgrpo.models.lora import LoRA
from jaxgrpo.models.lora import merge as merge_lora
from jaxgrpo.sharding import ShardingCtx, shard_act
from jaxgrpo.types import Array


def _einsum_kw(cfg: ModelConfig, stack: tuple[int, ...], rngs: nnx.Rngs) -> dict:
    """The keyword arguments every projection of a block shares."""
    return dict(
        stack=stack, param_dtype=cfg.param_dtype, dtype=cfg.dtype, platform=cfg.platform, rngs=rngs
    )


def _lora_for(cfg: ModelConfig, target: str):
    return cfg.lora if cfg.lora is not None and target in cfg.lora.targets else None


class Attention(nnx.Module):
    """GQA self-attention with optional q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = _einsum_kw(cfg, stack, rngs)
        self.q = Einsum(
            (d,),
            (n, h),
            ("embed",),
            ("heads", "head_dim"),
            bias=cfg.qkv_bias,
            lora=_lora_for(cfg, "q"),
            **kw,
        )
        self.k = Einsum(
            (d,),
            (k, h),
            ("embed",),
            ("kv_heads", "head_dim"),
            bias=cfg.qkv_bias,
            lora=_lora_for(cfg, "k"),
            **kw,
        )
        self.v = Einsum(
            (d,),
            (k, h),
            ("embed",),
            ("kv_heads", "head_dim"),
            bias=cfg.qkv_bias,
            lora=_lora_for(cfg, "v"),
            **kw,
        )
        self.o = Einsum(
            (n, h),
            (d,),
            ("heads", "head_dim"),
            ("embed",),
            bias=cfg.o_bias,
            lora=_lora_for(cfg, "o"),
            **kw,
        )
        norm_kw = dict(stack=stack, param_dtype=cfg.param_dtype)
        self.q_norm = RMSNorm(h, "head_dim", cfg.rms_norm_eps, **norm_kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, "head_dim", cfg.rms_norm_eps, **norm_kw) if cfg.qk_norm else None

    def qkv(self, x_BTD: Array, cos: Array, sin: Array, ctx: ShardingCtx | None):
        """Projects, normalises (Qwen3) and rotates: q [B,T,N,H], k and v [B,T,K,H]."""
        q_BTNH = self.q(x_BTD)
        k_BTKH = self.k(x_BTD)
        v_BTKH = self.v(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = shard_act(apply_rope(q_BTNH, cos, sin), _HEAD_AXES, ctx)
        k_BTKH = shard_act(apply_rope(k_BTKH, cos, sin), _KV_AXES, ctx)
        return q_BTNH, k_BTKH, shard_act(v_BTKH, _KV_AXES, ctx)


_HEAD_AXES = ("act_batch", "act_length", "act_heads", "act_head_dim")
_KV_AXES = ("act_batch", "act_length", "act_kv_heads", "act_head_dim")
_X_AXES = ("act_batch", "act_length", "act_embed")


class MLP(nnx.Module):
    """SwiGLU with gate and up fused into one [D, 2, F] kernel (one matmul instead of two).

    LoRA on gate and up stays two separate adapters, so the export is PEFT-compatible.
    """

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = _einsum_kw(cfg, stack, rngs)
        self.gate_up = Einsum((d,), (2, f), ("embed",), (None, "mlp"), **kw)
        self.down = Einsum((f,), (d,), ("mlp",), ("embed",), lora=_lora_for(cfg, "down"), **kw)
        lora_kw = dict(stack=stack, param_dtype=cfg.param_dtype, rngs=rngs)
        gate_cfg, up_cfg = _lora_for(cfg, "gate"), _lora_for(cfg, "up")
        self.gate_lora = (
            LoRA((d,), (f,), ("embed",), ("mlp",), gate_cfg, **lora_kw) if gate_cfg else None
        )
        self.up_lora = LoRA((d,), (f,), ("embed",), ("mlp",), up_cfg, **lora_kw) if up_cfg else None

    def __call__(self, x_BTD: Array, ctx: ShardingCtx | None) -> Array:
        gu_BT2F = self.gate_up(x_BTD)
        gate_BTF, up_BTF = gu_BT2F[..., 0, :], gu_BT2F[..., 1, :]
        if self.gate_lora is not None:
            gate_BTF = gate_BTF + self.gate_lora(x_BTD.astype(gate_BTF.dtype))
        if self.up_lora is not None:
            up_BTF = up_BTF + self.up_lora(x_BTD.astype(up_BTF.dtype))
        h_BTF = shard_act(
            jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp"), ctx
        )
        return self.down(h_BTF)

    def merge_lora(self) -> None:
        """Folds gate/up adapters into their halves of the fused kernel and zeroes their B."""
        kernel = self.gate_up.kernel[...]
        for slot, adapter in ((0, self.gate_lora), (1, self.up_lora)):
            if adapter is not None:
                delta = adapter.delta_kernel().astype(jnp.float32)
                kernel = kernel.at[..., slot, :].add(delta.astype(kernel.dtype))
                adapter.zero()
        self.gate_up.kernel[...] = kernel


class Block(nnx.Module):
    """One pre-norm decoder layer; constructed with stack=(L,) to hold all layers' weights."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(d, "embed", eps, stack=stack, param_dtype=cfg.param_dtype)
        self.attn = Attention(cfg, stack=stack, rngs=rngs)
        self.mlp_norm = RMSNorm(d, "embed", eps, stack=stack, param_dtype=cfg.param_dtype)
        self.mlp = MLP(cfg, stack=stack, rngs=rngs)

    def __call__(
        self,
        x_BTD: Array,
        cos: Array,
        sin: Array,
        mask_BTS: Array,
        *,
        kv: tuple[Array, Array] | None = None,
        layer: Array | None = None,
        index: Array | None = None,
        prefix_kv: tuple[Array, Array] | None = None,
        emit_kv: bool = False,
        ctx: ShardingCtx | None = None,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """One layer on per-layer weights.

        Args:
            x_BTD: residual stream.
            cos / sin: RoPE tables [B, T, 1, H/2].
            mask_BTS: True where query t may attend key slot s (S = T without a cache, P + T
                with `prefix_kv`).
            kv: None, or the whole stacked cache (k, v), each [L, B, S, K, H]; the new keys are
                written at (layer, :, index) and attention reads the whole of layer `layer`.
            layer / index: this layer's number and the first slot to write (with kv).
            prefix_kv: without kv, this layer's keys and values [B, P, K, H] of P earlier
                tokens (a prompt), attended before the T new ones and never written to.
            emit_kv: without kv, return the T new (k, v) [B, T, K, H] instead of None.
            ctx: activation sharding context.

        Returns:
            (new residual stream, updated (k, v), the new (k, v) with `emit_kv`, or None).
        """
        h_BTD = self.attn_norm(x_BTD)
        q_BTNH, k_BTKH, v_BTKH = self.attn.qkv(h_BTD, cos, sin, ctx)
        if kv is not None:
            k_LBSKH, v_LBSKH = kv
            start = (layer, 0, index, 0, 0)
            k_LBSKH = jax.lax.dynamic_update_slice(
                k_LBSKH, k_BTKH[None].astype(k_LBSKH.dtype), start
            )
            v_LBSKH = jax.lax.dynamic_update_slice(
                v_LBSKH, v_BTKH[None].astype(v_LBSKH.dtype), start
            )
            k_BTKH = jax.lax.dynamic_index_in_dim(k_LBSKH, layer, 0, keepdims=False)
            v_BTKH = jax.lax.dynamic_index_in_dim(v_LBSKH, layer, 0, keepdims=False)
            kv = (k_LBSKH, v_LBSKH)
        elif emit_kv:
            kv = (k_BTKH, v_BTKH)
        if prefix_kv is not None:
            pk_BPKH, pv_BPKH = prefix_kv
            k_BTKH = jnp.concatenate([pk_BPKH.astype(k_BTKH.dtype), k_BTKH], axis=1)
            v_BTKH = jnp.concatenate([pv_BPKH.astype(v_BTKH.dtype), v_BTKH], axis=1)
        attn_BTNH = attend(q_BTNH, k_BTKH, v_BTKH, mask_BTS)
        x_BTD = x_BTD + self.attn.o(attn_BTNH).astype(x_BTD.dtype)
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD), ctx).astype(x_BTD.dtype)
        return shard_act(x_BTD, _X_AXES, ctx), kv


class Transformer(nnx.Module):
    """Decoder-only LM. `model(ids_BT, attention_mask=mask_BT) -> logits_BTV` (float32).

    Attributes:
        cfg: the ModelConfig.
        shard_ctx: mesh + rules used to constrain activations, or None (set by
            `jaxgrpo.models.init.random_model`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        emb = jax.random.normal(rngs.params(), (v, d), jnp.float32) * 0.02
        self.embed = nnx.Param(emb.astype(cfg.param_dtype), logical_axes=("vocab", "embed"))
        self.layers = Block(cfg, stack=(cfg.num_layers,), rngs=rngs)
        self.final_norm = RMSNorm(d, "embed", cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        # The head is stored [V, D] like the embedding: XLA:CPU ran `x @ W.T` with W [V, D]
        # about 2x faster than with W stored [D, V] at decode shapes (measured, B=32, D=576).
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
        h_BTD, _ = self.hidden(input_ids_BT, attention_mask)
        return self.logits(h_BTD)

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

    def hidden(
        self,
        input_ids_BT: Array,
        attention_mask_BT: Array | None = None,
        positions_BT: Array | None = None,
        cache: KVCache | LayerKVCache | None = None,
        layers: Sequence[DecodeLayer] | None = None,
        attention_BTS: Array | None = None,
        prefix_kv: tuple[Array, Array] | None = None,
        return_kv: bool = False,
    ) -> tuple[Array, Any]:
        """Final-normed hidden states, and the updated cache (or the new keys and values).

        Args:
            input_ids_BT: int token ids [B, T].
            attention_mask_BT: 1 for real tokens, 0 for (left) padding; default all ones.
            positions_BT: position ids; default `cumsum(mask) - 1` (offset by the cache's
                `next_pos`), clipped at 0.
            cache: None for a plain forward; otherwise the T new keys are written at slots
                [cache.index, cache.index + T) and attention covers the whole cache.
            layers: the decode path: `decode_layers()`, run one after the other instead of
                scanning the stacked weights, on a `LayerKVCache`.
            attention_BTS: bool [B, T, S]: which key slots each query attends, replacing the
                causal mask over valid slots (S = T, the cache's size, or P + T with
                `prefix_kv`). For packed sequences, where several completions share one row
                and one prompt.
            prefix_kv: stacked keys and values [L, B, P, K, H] of P earlier tokens (from a
                `return_kv` pass over a prompt), attended before the T new ones and not
                extended: the scoring passes' way to run completions after their prompt
                without a cache to write into. Needs `positions_BT` and `attention_BTS`.
            return_kv: without a cache, return the new tokens' keys and values, stacked
                [L, B, T, K, H], as the second value.

        Returns:
            (h_BTD in the compute dtype, the new cache, the (k, v) of `return_kv`, or None).
        """
        cfg, ctx = self.cfg, self.shard_ctx
        b, t = input_ids_BT.shape
        if prefix_kv is not None and (cache is not None or layers is not None):
            raise ValueError("hidden(prefix_kv=...) takes no cache or decode layers")
        if prefix_kv is not None and (positions_BT is None or attention_BTS is None):
            raise ValueError("hidden(prefix_kv=...) needs positions_BT and attention_BTS")
        if return_kv and cache is not None:
            raise ValueError("hidden(return_kv=True) runs without a cache")
        mask_BT = (
            jnp.ones((b, t), jnp.bool_) if attention_mask_BT is None else attention_mask_BT != 0
        )
        if positions_BT is None:
            offset_B1 = jnp.zeros((b, 1), jnp.int32) if cache is None else cache.next_pos[:, None]
            positions_BT = jnp.maximum(offset_B1 + jnp.cumsum(mask_BT, axis=1) - 1, 0)
        cos, sin = rope_cos_sin(positions_BT, rope_inv_freq(cfg))
        x_BTD = jnp.take(self.embed[...], input_ids_BT, axis=0).astype(cfg.dtype)
        x_BTD = shard_act(x_BTD, _X_AXES, ctx)

        if cache is None:
            q_pos_T = jnp.arange(t)
            key_mask_BS = mask_BT
        else:
            q_pos_T = cache.index + jnp.arange(t)
            key_mask_BS = jax.lax.dynamic_update_slice(cache.mask, mask_BT, (0, cache.index))
        s = key_mask_BS.shape[1] + (0 if prefix_kv is None else prefix_kv[0].shape[2])
        if attention_BTS is None:
            causal_TS = jnp.arange(s)[None, :] <= q_pos_T[:, None]
            mask_BTS = key_mask_BS[:, None, :] & causal_TS[None, :, :]
        elif attention_BTS.shape != (b, t, s):
            raise ValueError(f"attention_BTS has shape {attention_BTS.shape}, want {(b, t, s)}")
        else:
            mask_BTS = attention_BTS.astype(jnp.bool_)

        if layers is not None:
            x_BTD, kv = self._run_decode_layers(layers, x_BTD, cos, sin, mask_BTS, cache)
        else:
            x_BTD, kv = self._run_layers(x_BTD, cos, sin, mask_BTS, cache, prefix_kv, return_kv)
        h_BTD = self.final_norm(x_BTD)
        if cache is not None:
            cache = cache.replace(
                k=kv[0],
                v=kv[1],
                mask=key_mask_BS,
                next_pos=cache.next_pos + jnp.sum(mask_BT, axis=1, dtype=jnp.int32),
                index=cache.index + t,
            )
        return h_BTD, kv if return_kv else cache

    @property
    def scans_decode(self) -> bool:
        """Whether the sampler's decode steps scan stacked layers (`ModelConfig.scan_decode`)."""
        if self.cfg.scan_decode is not None:
            return self.cfg.scan_decode
        return (self.cfg.platform or jax.default_backend()) != "cpu"

    def decode_layers(self) -> list[DecodeLayer] | DecodeLayer:
        """The L layers in the decode layout: adapters folded in, matrices [out, in].

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

    def _run_decode_layers(self, layers, x_BTD, cos, sin, mask_BTS, cache):
        """The decode path of `hidden`: a scan over stacked `DecodeLayer`s carrying the
        stacked cache, or an unrolled loop over per-layer ones."""
        if not isinstance(cache, LayerKVCache):
            raise TypeError("hidden(layers=...) decodes into a LayerKVCache")
        if isinstance(layers, DecodeLayer) != cache.stacked:
            raise TypeError("stacked decode layers go with a stacked LayerKVCache")
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

    def _run_layers(
        self, x_BTD, cos, sin, mask_BTS, cache: KVCache | None, prefix_kv=None, emit_kv=False
    ):
        """Scans (or unrolls) the stacked Block over L; carries x and (if decoding) the cache.

        Without a cache, layer i reads `prefix_kv[.][i]` (if given) as its prefix and, with
        `emit_kv`, its new keys and values are stacked as the scan's outputs.
        """
        graphdef, state = nnx.split(self.layers)
        ctx = self.shard_ctx
        index = None if cache is None else cache.index

        def body(carry, xs):
            x_BTD, kv = carry
            layer_state, layer, prefix = xs
            block = nnx.merge(graphdef, layer_state)
            x_BTD, out = block(
                x_BTD, cos, sin, mask_BTS, kv=kv, layer=layer, index=index,
                prefix_kv=prefix, emit_kv=emit_kv, ctx=ctx,
            )  # fmt: skip
            return ((x_BTD, out), None) if kv is not None else ((x_BTD, None), out)

        if self.cfg.remat:
            body = jax.checkpoint(body)
        kv0 = None if cache is None else (cache.k, cache.v)
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        unroll = self.cfg.num_layers if self.cfg.unroll_layers else 1
        (x_BTD, kv), new_kv = jax.lax.scan(
            body, (x_BTD, kv0), (state, layers, prefix_kv), unroll=unroll
        )
        return x_BTD, kv if cache is not None else new_kv


def layer_block(model: Transformer, i: int) -> Block:
    """Layer i of the stacked decoder as an ordinary (unstacked) Block, e.g. for tests."""
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))
