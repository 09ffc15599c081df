"""The decode-step layers: per-layer weights laid out for one-token matmuls.

A decode step multiplies a few rows ([B, 1, D]) by every weight of the model, so the layout
is chosen for those matmuls: each layer's weights are separate arrays (or one stacked set for
the scanned loop), prepared once per `generate` call with the adapters folded in, and every
kernel is a plain 2-D [in, out] matrix, which XLA:CPU's dot (YNNPACK's,
`jaxgrpo.core.host.CPU_XLA_FLAGS`) reads faster than [out, in] (benchmarks/README.md,
"Decode-layout weights").

`DecodeLayer` is built from a `Block` (`decode_layer_from_block`) and run by `decode_layer`
through the same `layers.decoder_layer` body as `Block.__call__`; only the weight layout and
the cache differ: keys and values go to a `LayerKVCache`, whose prompt part is stored once
per prompt and shared by its G samples.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo.core import sharding
from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx
from jaxgrpo.models.layers import attend, decoder_layer, rms_norm


@flax.struct.dataclass
class DecodeLayer:
    """One layer's weights as 2-D [in, out] matrices in the compute dtype.

    Attributes:
        attn_norm / mlp_norm: RMSNorm scales [D].
        qkv: [D, K * (M + 2) * H] (M = N / K): for each kv head, the columns of its M query
            heads, then its key's, then its value's. One matmul instead of three (the key and
            value ones alone are narrow and run slowly on XLA:CPU); grouped by kv head so that
            splitting the columns over ``tensor`` gives each device whole heads (no exchange
            between the projection and attention).
        o: [N*H, D].
        qkv_bias: [K * (M + 2) * H] in the same order, or None when q, k and v have no bias;
            o_bias: [D] or None.
        q_norm / k_norm: Qwen3 per-head RMSNorm scales [H], or None.
        gate_up: [D, F * 2], column 2f the gate's f-th output and column 2f + 1 the up
            projection's, so a split over ``tensor`` keeps each gate with its up column.
        down: [F, D].
        eps: RMSNorm epsilon (static).
    """

    attn_norm: Array
    qkv: Array
    o: Array
    mlp_norm: Array
    gate_up: Array
    down: Array
    qkv_bias: Array | None = None
    o_bias: Array | None = None
    q_norm: Array | None = None
    k_norm: Array | None = None
    eps: float = flax.struct.field(pytree_node=False, default=1e-6)


def _matrix(kernel: Array, n_in: int, dtype) -> Array:
    """A kernel [*in, *out] as the matrix [prod(in), prod(out)]."""
    return kernel.reshape(math.prod(kernel.shape[:n_in]), -1).astype(dtype)


def _by_kv_head(q: Array, k: Array, v: Array, kv_heads: int) -> Array:
    """Columns [..., N*H], [..., K*H], [..., K*H] -> [..., K * (M+2) * H], grouped by kv head."""
    group = lambda x: x.reshape(*x.shape[:-1], kv_heads, -1)  # noqa: E731
    both = jnp.concatenate([group(q), group(k), group(v)], axis=-1)
    return both.reshape(*q.shape[:-1], -1)


def decode_layer_from_block(block, eps: float, dtype) -> DecodeLayer:
    """The weights of one unstacked `Block` (adapters already merged) in decode layout."""
    attn, mlp = block.attn, block.mlp
    kv_heads = attn.k.kernel.shape[1]
    qkv = (attn.q, attn.k, attn.v)
    qkv_bias = None
    if any(e.bias is not None for e in qkv):
        biases = [
            jnp.zeros(e.kernel.shape[1:], dtype).reshape(-1)
            if e.bias is None
            else e.bias[...].reshape(-1).astype(dtype)
            for e in qkv
        ]
        qkv_bias = _by_kv_head(*biases, kv_heads)
    norm = lambda n: None if n is None else n.scale[...]  # noqa: E731
    d, _, f = mlp.gate_up.kernel.shape
    return DecodeLayer(
        attn_norm=block.attn_norm.scale[...],
        qkv=_by_kv_head(*[_matrix(e.kernel[...], 1, dtype) for e in qkv], kv_heads),
        o=_matrix(attn.o.kernel[...], 2, dtype),
        mlp_norm=block.mlp_norm.scale[...],
        # [D, 2, F] -> [D, F, 2] -> [D, 2F]: columns (f, gate/up)
        gate_up=mlp.gate_up.kernel[...].transpose(0, 2, 1).reshape(d, 2 * f).astype(dtype),
        down=_matrix(mlp.down.kernel[...], 1, dtype),
        qkv_bias=qkv_bias,
        o_bias=None if attn.o.bias is None else attn.o.bias[...].reshape(-1).astype(dtype),
        q_norm=norm(attn.q_norm),
        k_norm=norm(attn.k_norm),
        eps=eps,
    )


def shard_decode_layer(w: DecodeLayer, ctx: ShardingCtx | None, kv_heads: int) -> DecodeLayer:
    """Under the sampling rules, pins the matrices tensor-parallel: q/k/v and gate/up split
    their output columns over the heads' mesh axes (``tensor``; fsdp x tensor under
    ``SAMPLE_TP_RULES``; whole kv-head groups, whole F pairs), o and down their input rows, so a
    layer needs two all-reduces of a few activation rows (after o and after down) and nothing
    else; vectors replicate (XLA slices them). Other rules leave XLA to choose.
    """
    if ctx is None or sharding.rules_name(ctx.rules) not in ("sample", "sample_tp"):
        return w

    def axis(rule: str, size: int):  # the rule's mesh axes, or None where they do not divide
        return sharding.logical_to_spec((rule,), ctx.rules, (size,), ctx.mesh)[0]

    heads, mlp = axis("heads", kv_heads), axis("mlp", w.down.shape[-2])
    specs = dict(
        qkv=PartitionSpec(None, heads),
        o=PartitionSpec(heads, None),
        gate_up=PartitionSpec(None, mlp),
        down=PartitionSpec(mlp, None),
    )

    def pin(name, x):
        if x is None:
            return None
        spec = specs.get(name, PartitionSpec())
        if x.ndim > len(spec):  # stacked [L, ...] weights of the scanned decode loop
            spec = PartitionSpec(*(None,) * (x.ndim - len(spec)), *spec)
        return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))

    fields = {
        f.name: pin(f.name, getattr(w, f.name)) for f in dataclasses.fields(w) if f.name != "eps"
    }
    return DecodeLayer(**fields, eps=w.eps)


def _project(x_BTI: Array, w_IO: Array, b_O: Array | None) -> Array:
    """`x @ w (+ b)`: [B, T, I] -> [B, T, O]."""
    y_BTO = jnp.einsum("BTI,IO->BTO", x_BTI, w_IO)
    return y_BTO if b_O is None else y_BTO + b_O.reshape(1, 1, -1)


def decode_layer(
    w: DecodeLayer,
    x_BTD: Array,
    cos: Array,
    sin: Array,
    mask_BTS: Array,
    kv: tuple[Array, Array],
    index: Array,
    prompt_kv: tuple[Array, Array],
    prompt_mask: Array,
    ctx: ShardingCtx | None = None,
    layer: Array | None = None,
) -> tuple[Array, tuple[Array, Array]]:
    """`Block.__call__` on decode-layout weights and this layer's part of a `LayerKVCache`.

    Args:
        w: the layer's weights.
        x_BTD: residual stream (compute dtype).
        cos / sin: RoPE tables [B, T, 1, H/2].
        mask_BTS: True where query t may attend completion slot s.
        kv: this layer's completion keys [B, K, H, S] and values [B, K, S, H]; the T new
            keys and values are written at slots [index, index + T).
        index: int32 scalar, the first slot to write.
        prompt_kv: this layer's prompt keys [B / G, K, H, P] and values [B / G, K, P, H],
            shared by the G rows of each prompt; every query attends its prompt's valid
            slots.
        prompt_mask: [B / G, P] bool, the valid prompt slots.
        ctx: activation sharding context.
        layer: with stacked caches (the scanned decode loop): ``kv`` is every layer's
            [L, ...] buffers and this layer is ``layer`` of them; only its T new slots are
            written, so the loop carries the cache in place.

    Returns:
        (new residual stream, updated (k, v)).
    """

    def attend_fn(q_BTNH, k_BTKH, v_BTKH):
        k, v = kv
        new_k, new_v = k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3)
        if layer is None:
            k = jax.lax.dynamic_update_slice(k, new_k.astype(k.dtype), (0, 0, 0, index))
            v = jax.lax.dynamic_update_slice(v, new_v.astype(v.dtype), (0, 0, index, 0))
            k_BKHS, v_BKSH = k, v
        else:
            start_k, start_v = (layer, 0, 0, 0, index), (layer, 0, 0, index, 0)
            k = jax.lax.dynamic_update_slice(k, new_k[None].astype(k.dtype), start_k)
            v = jax.lax.dynamic_update_slice(v, new_v[None].astype(v.dtype), start_v)
            k_BKHS = jax.lax.dynamic_index_in_dim(k, layer, keepdims=False)
            v_BKSH = jax.lax.dynamic_index_in_dim(v, layer, keepdims=False)
        prompt = (*prompt_kv, prompt_mask)
        attn_BTNH = attend(q_BTNH, k_BKHS, v_BKSH, mask_BTS, heads_first=True, prompt=prompt)
        return attn_BTNH, (k, v)

    return decoder_layer(_DecodeOps(w, cos.shape[-1] * 2), x_BTD, cos, sin, attend_fn, ctx)


class _DecodeOps:
    """A `DecodeLayer` as the operations of `layers.LayerWeights` (head_dim H static)."""

    def __init__(self, w: DecodeLayer, head_dim: int):
        self.w, self.h = w, head_dim

    def attn_norm(self, x_BTD: Array) -> Array:
        return rms_norm(x_BTD, self.w.attn_norm, self.w.eps)

    def mlp_norm(self, x_BTD: Array) -> Array:
        return rms_norm(x_BTD, self.w.mlp_norm, self.w.eps)

    def qkv(self, h_BTD: Array) -> tuple[Array, Array, Array]:
        w, h = self.w, self.h
        b, t, _ = h_BTD.shape
        qkv_BTX = _project(h_BTD, w.qkv, w.qkv_bias)
        n = w.o.shape[0] // h
        k = (qkv_BTX.shape[-1] // h - n) // 2
        grouped = qkv_BTX.reshape(b, t, k, n // k + 2, h)  # [B, T, K, M + 2, H]
        q_BTNH = grouped[..., : n // k, :].reshape(b, t, n, h)
        k_BTKH, v_BTKH = grouped[..., -2, :], grouped[..., -1, :]
        if w.q_norm is not None:
            q_BTNH, k_BTKH = rms_norm(q_BTNH, w.q_norm, w.eps), rms_norm(k_BTKH, w.k_norm, w.eps)
        return q_BTNH, k_BTKH, v_BTKH

    def o(self, a_BTNH: Array) -> Array:
        b, t = a_BTNH.shape[:2]
        return _project(a_BTNH.reshape(b, t, -1), self.w.o, self.w.o_bias)

    def gate_up(self, h_BTD: Array) -> tuple[Array, Array]:
        b, t, _ = h_BTD.shape
        gate_up_BTF2 = _project(h_BTD, self.w.gate_up, None).reshape(b, t, -1, 2)
        return gate_up_BTF2[..., 0], gate_up_BTF2[..., 1]

    def down(self, a_BTF: Array) -> Array:
        return _project(a_BTF, self.w.down, None)
