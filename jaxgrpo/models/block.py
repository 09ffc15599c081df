"""One decoder layer's modules: `Attention`, the fused-SwiGLU `MLP` and the pre-norm `Block`.

`Block` holds one layer's weights, or all L layers' stacked [L, ...] when built with
stack=(L,) (`jaxgrpo.models.transformer.Transformer` scans it), and runs the shared layer body
`layers.decoder_layer`, implementing its `LayerWeights` operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.layers import (
    BandedMask,
    Einsum,
    RMSNorm,
    attend,
    banded_attend,
    decoder_layer,
)
from jaxgrpo.models.lora import LoRA


def _einsum_kw(cfg: ModelConfig, stack: tuple[int, ...], rngs: nnx.Rngs) -> dict:
    """The keyword arguments every projection of a block shares."""
    return dict(
        stack=stack,
        param_dtype=cfg.param_dtype,
        dtype=cfg.dtype,
        projection=cfg.layout.projection,
        rngs=rngs,
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

    def qkv(self, x_BTD: Array) -> tuple[Array, Array, Array]:
        """Projects and normalises (Qwen3): q [B,T,N,H], k and v [B,T,K,H], before RoPE."""
        q_BTNH = self.q(x_BTD)
        k_BTKH = self.k(x_BTD)
        v_BTKH = self.v(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        return q_BTNH, k_BTKH, v_BTKH


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

    def gate_and_up(self, x_BTD: Array) -> tuple[Array, Array]:
        """The gate and up projections [B, T, F], each with its adapter."""
        gu_BT2F = self.gate_up(x_BTD)
        gate_BTF, up_BTF = gu_BT2F[..., 0, :], gu_BT2F[..., 1, :]
        if self.gate_lora is not None:
            gate_BTF = gate_BTF + self.gate_lora(x_BTD.astype(gate_BTF.dtype))
        if self.up_lora is not None:
            up_BTF = up_BTF + self.up_lora(x_BTD.astype(up_BTF.dtype))
        return gate_BTF, up_BTF

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
        self.attention_kernel = cfg.layout.attention

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

        def attend_fn(q_BTNH, k_BTKH, v_BTKH):
            new_kv = (k_BTKH, v_BTKH) if emit_kv else None
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
                new_kv = (k_LBSKH, v_LBSKH)
            if isinstance(mask_BTS, BandedMask):
                return banded_attend(
                    q_BTNH, k_BTKH, v_BTKH, prefix_kv, mask_BTS, self.attention_kernel
                ), new_kv
            if prefix_kv is not None:
                pk_BPKH, pv_BPKH = prefix_kv
                k_BTKH = jnp.concatenate([pk_BPKH.astype(k_BTKH.dtype), k_BTKH], axis=1)
                v_BTKH = jnp.concatenate([pv_BPKH.astype(v_BTKH.dtype), v_BTKH], axis=1)
            return attend(q_BTNH, k_BTKH, v_BTKH, mask_BTS), new_kv

        return decoder_layer(self, x_BTD, cos, sin, attend_fn, ctx)

    # The operations of `layers.LayerWeights` (attn_norm and mlp_norm are the RMSNorm modules).
    def qkv(self, h_BTD: Array) -> tuple[Array, Array, Array]:
        return self.attn.qkv(h_BTD)

    def o(self, a_BTNH: Array) -> Array:
        return self.attn.o(a_BTNH)

    def gate_up(self, h_BTD: Array) -> tuple[Array, Array]:
        return self.mlp.gate_and_up(h_BTD)

    def down(self, a_BTF: Array) -> Array:
        return self.mlp.down(a_BTF)
