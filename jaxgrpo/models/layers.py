"""Building blocks of the decoder: projections with logical axes, RMSNorm, RoPE, attention.

Every parameter is an `nnx.Param` whose `logical_axes` metadata names each dimension from the
vocabulary in `jaxgrpo.core.sharding` (embed, heads, kv_heads, head_dim, mlp, vocab, layers,
lora_rank). We keep our own metadata key rather than flax's `out_sharding`: flax shards such
variables eagerly against a global mesh, and jaxgrpo passes its mesh explicitly instead.

Parameters may carry leading "stack" dimensions (the L axis of the scanned decoder); the modules
are written for one layer and are called on per-layer slices inside `jax.lax.scan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx, shard_act
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.kernels import ATTENTIONS, PROJECTIONS
from jaxgrpo.models.lora import LoRA

# Logical axes of a layer's activations, for every layout of its weights.
X_AXES = ("act_batch", "act_length", "act_embed")  # residual stream [B, T, D]
HEAD_AXES = ("act_batch", "act_length", "act_heads", "act_head_dim")  # queries [B, T, N, H]
KV_AXES = ("act_batch", "act_length", "act_kv_heads", "act_head_dim")  # keys, values [B, T, K, H]
MLP_AXES = ("act_batch", "act_length", "act_mlp")  # SwiGLU product [B, T, F]

# What `decoder_layer` names for a remat policy to keep (`jax.ad_checkpoint.checkpoint_name`):
# the outputs of its projections (q and k after RoPE, v, the attention output the o projection
# reads, gate and up) and the residual stream between attention and MLP. A backward pass that
# keeps them recomputes only the attention core and elementwise work, not the projections.
PROJECTION_OUTPUTS = ("q", "k", "v", "attention", "mid_residual", "gate", "up")


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


class Einsum(nnx.Module):
    """A projection `y[..., *out] = sum_in x[..., *in] W[*in, *out] (+ b) (+ LoRA)`.

    Args:
        in_shape / out_shape: contracted and produced dims (e.g. (D,) -> (N, H)).
        in_axes / out_axes: their logical names.
        stack: leading dims of the stored weights (e.g. (L,)), named "layers".
        bias: add a bias of shape out_shape.
        lora: adapter settings, or None for no adapter.
        projection: the kernel (`jaxgrpo.models.kernels.PROJECTIONS`; the run's
            `Layout.projection`).
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        *,
        stack: tuple[int, ...] = (),
        bias: bool = False,
        lora: LoRAConfig | None = None,
        param_dtype: str = "float32",
        dtype: str = "float32",
        projection: str = "jax",
        rngs: nnx.Rngs,
    ):
        stack_axes = ("layers",) * len(stack)
        fan_in = math.prod(in_shape)
        w = jax.random.normal(rngs.params(), (*stack, *in_shape, *out_shape), jnp.float32)
        self.kernel = nnx.Param(
            (w / math.sqrt(fan_in)).astype(param_dtype),
            logical_axes=(*stack_axes, *in_axes, *out_axes),
        )
        self.bias = (
            nnx.Param(
                jnp.zeros((*stack, *out_shape), param_dtype),
                logical_axes=(*stack_axes, *out_axes),
            )
            if bias
            else None
        )
        self.lora = (
            LoRA(
                in_shape,
                out_shape,
                in_axes,
                out_axes,
                lora,
                stack=stack,
                param_dtype=param_dtype,
                rngs=rngs,
            )
            if lora is not None
            else None
        )
        self.n_in = len(in_shape)
        self.dtype = dtype
        self.projection = projection

    def __call__(self, x: Array) -> Array:
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        y = PROJECTIONS[self.projection](x, kernel, self.n_in)
        if self.bias is not None:
            y = y + _lead(self.bias[...].astype(self.dtype), y.ndim)
        if self.lora is not None:
            y = y + self.lora(x)
        return y

    def merge_lora(self) -> None:
        """Folds the adapter into `kernel` and zeroes its B (see `jaxgrpo.models.lora.merge`)."""
        if self.lora is not None:
            delta = self.lora.delta_kernel()
            self.kernel[...] = (self.kernel[...] + delta).astype(self.kernel[...].dtype)
            self.lora.zero()


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in float32 (as transformers does).

    Args:
        dim: size of the normalised axis.
        axis_name: its logical name ("embed" or "head_dim").
        stack: leading dims of the stored scale.
    """

    def __init__(
        self,
        dim: int,
        axis_name: str,
        eps: float,
        *,
        stack: tuple[int, ...] = (),
        param_dtype: str = "float32",
    ):
        self.scale = nnx.Param(
            jnp.ones((*stack, dim), param_dtype),
            logical_axes=(*("layers",) * len(stack), axis_name),
        )
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """`x / rms(x) * scale` along the last axis; float32 inside, x's dtype out."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps) * _lead(scale.astype(jnp.float32), x.ndim)).astype(
        x.dtype
    )


def _lead(w: Array, ndim: int) -> Array:
    """Adds leading unit dims so w broadcasts explicitly against an ndim-rank array."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2] (float64 numpy, static), with llama3 scaling when configured."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if not cfg.rope_scaling:
        return inv
    p = dict(cfg.rope_scaling)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    # Between the two wavelength cut-offs, interpolate smoothly between scaled and unscaled.
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, smoothed, scaled)


def rope_cos_sin(positions_BT: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """cos and sin tables [B, T, 1, H/2] (float32) for integer positions [B, T]."""
    angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(
        inv_freq, jnp.float32
    ).reshape(1, 1, -1)
    return jnp.cos(angles_BTh)[:, :, None, :], jnp.sin(angles_BTh)[:, :, None, :]


def apply_rope(x_BTNH: Array, cos: Array, sin: Array) -> Array:
    """Rotates the two halves of the head dim (the transformers "rotate_half" layout)."""
    half = x_BTNH.shape[-1] // 2
    x32 = x_BTNH.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def attend(
    q_RTNH: Array,
    k: Array,
    v: Array,
    mask_RTS: Array,
    *,
    heads_first: bool = False,
    prompt: tuple[Array, Array, Array] | None = None,
    kernel: str = "jax",
) -> Array:
    """Grouped-query softmax attention over R rows; scores and softmax in float32.

    With `prompt`, the rows are the R = B * G samples of B prompts (rows b*G .. b*G+G-1 of
    prompt b), and each prompt's keys, stored once, come before the rows' own. The prompt's
    scores are one matmul per (prompt, kv head) with the group's G * M * T queries as rows, so
    a decode step reads the prompt cache once per group instead of once per row. The softmax
    over the prompt and the own slots together is taken part by part (one running maximum,
    then each part's unnormalised weights and their values; one division at the end), so the
    two score arrays are never concatenated, nor sliced apart again in the backward pass.

    Args:
        q_RTNH: queries, N = K * M (M query heads share each kv head).
        k / v: keys and values [R, S, K, H]; with `heads_first` (the decode cache's layout)
            keys [R, K, H, S] and values [R, K, S, H].
        mask_RTS: True where query t may attend key s.
        prompt: None, or the prompts' keys [B, K, H, P], values [B, K, P, H] and mask [B, P]
            (True at real slots, which every query of the prompt's rows may attend).
        kernel: the attention kernel (`jaxgrpo.models.kernels.ATTENTIONS`; the run's
            `Layout.attention`).

    Returns:
        [R, T, N, H] in q's dtype.
    """
    r, t, n, h = q_RTNH.shape
    kh = k.shape[1 if heads_first else 2]
    q_RKMTH = q_RTNH.reshape(r, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    out_RKMTH = ATTENTIONS[kernel](q_RKMTH, k, v, mask_RTS, prompt, heads_first)
    return out_RKMTH.transpose(0, 3, 1, 2, 4).reshape(r, t, n, h).astype(q_RTNH.dtype)


@flax.struct.dataclass
class BandedMask:
    """Which keys the queries of packed rows attend when no segment is longer than
    ``back * width`` columns: a query's own segment then lies in its block of ``width`` columns
    or the ``back`` blocks before it, so block j attends the prompt and key blocks j-back .. j
    only, [W, P + (back + 1) W] scores per block where the dense mask would need [L, P + L] per
    row (the update's largest buffers).

    Attributes:
      own_XWV: bool [B * L / W, W, (back + 1) W]: query w of block j may attend column
        (j - back) W + v.
      prompt_BP: bool [B, P]: the prompt's real slots, which every query may attend.
      width: W.
      back: how many earlier blocks a block attends.
    """

    own_XWV: Array
    prompt_BP: Array
    width: int = flax.struct.field(pytree_node=False)
    back: int = flax.struct.field(pytree_node=False, default=1)


def banded_mask(seg_BL: Array, prompt_BP: Array, width: int, back: int = 1) -> BandedMask:
    """The `BandedMask` of packed rows whose column c belongs to segment ``seg_BL[:, c]``
    (-1 = padding); a query attends the earlier columns of its own segment and itself.
    L must be a multiple of ``width``, and no segment longer than ``back * width``."""
    b, cols = seg_BL.shape
    blocks, span = cols // width, back * width
    query_JW = jnp.arange(cols).reshape(blocks, width)
    key_JV = query_JW[:, :1] - span + jnp.arange(span + width)[None, :]
    padded_BC = jnp.pad(seg_BL, ((0, 0), (span, 0)), constant_values=-1)
    seg_key_BJV = jnp.take(padded_BC, key_JV + span, axis=1)
    seg_query_BJW = seg_BL.reshape(b, blocks, width)
    own = (
        (seg_query_BJW[..., :, None] == seg_key_BJV[..., None, :])
        & (seg_key_BJV[..., None, :] >= 0)
        & (key_JV[:, None, :] <= query_JW[:, :, None])[None]
    )
    return BandedMask(own.reshape(b * blocks, width, span + width), prompt_BP, width, back)


def banded_attend(
    q_BLNH: Array,
    k_BLKH: Array,
    v_BLKH: Array,
    prefix_kv: tuple[Array, Array],
    mask: BandedMask,
    kernel: str = "jax",
) -> Array:
    """`attend` for packed rows under a `BandedMask`: each block of W queries is a row of its
    own whose keys are the prompt's (``prefix_kv``, each [B, P, K, H], shared by the row's
    blocks through `attend`'s ``prompt``) and the row's key blocks j-back .. j. [B, L, N, H]."""
    b, cols, n, h = q_BLNH.shape
    w, back = mask.width, mask.back
    blocks = cols // w

    def block_window(x_BLKH):  # [B, L, K, H] -> [B * L / W, K, H, (back + 1) W]
        x_BKHL = jnp.pad(x_BLKH.transpose(0, 2, 3, 1), ((0, 0), (0, 0), (0, 0), (back * w, 0)))
        shifted = [
            x_BKHL[..., i * w : i * w + cols].reshape(*x_BKHL.shape[:3], blocks, w)
            for i in range(back + 1)
        ]
        x_BKHJV = jnp.concatenate(shifted, axis=-1)
        return x_BKHJV.transpose(0, 3, 1, 2, 4).reshape(b * blocks, *x_BKHJV.shape[1:3], -1)

    pk_BPKH, pv_BPKH = prefix_kv
    prompt = (pk_BPKH.transpose(0, 2, 3, 1), pv_BPKH.transpose(0, 2, 1, 3), mask.prompt_BP)
    # The decode cache's layout (keys [R, K, H, S], values [R, K, S, H]): the score and value
    # dots then read their right-hand operands as [contracted, free], with no transposes of the
    # scores (benchmarks/README.md, "Heads-first key and value windows").
    out = attend(
        q_BLNH.reshape(b * blocks, w, n, h),
        block_window(k_BLKH),
        jnp.swapaxes(block_window(v_BLKH), -1, -2),
        mask.own_XWV,
        heads_first=True,
        prompt=prompt,
        kernel=kernel,
    )
    return out.reshape(b, cols, n, h)


class LayerWeights(Protocol):
    """One decoder layer's weights, as the operations `decoder_layer` applies.

    Implemented by `block.Block` (training layout, LoRA unmerged) and by the decode
    layout of `jaxgrpo.models.decode`; each owns its weight layout, not the arithmetic.
    """

    def attn_norm(self, x_BTD: Array) -> Array: ...

    def qkv(self, h_BTD: Array) -> tuple[Array, Array, Array]:
        """q [B, T, N, H], k and v [B, T, K, H], q/k-normed (Qwen3), before RoPE."""
        ...

    def o(self, a_BTNH: Array) -> Array: ...

    def mlp_norm(self, x_BTD: Array) -> Array: ...

    def gate_up(self, h_BTD: Array) -> tuple[Array, Array]:
        """The SwiGLU gate and up projections, each [B, T, F]."""
        ...

    def down(self, a_BTF: Array) -> Array: ...


# attend(q_BTNH, k_BTKH, v_BTKH) -> (attention output [B, T, N, H], the updated cache or None):
# owns where keys and values come from (a cache, a prefix) and where the new ones go.
AttendFn = Callable[[Array, Array, Array], tuple[Array, Any]]


def decoder_layer(
    w: LayerWeights,
    x_BTD: Array,
    cos: Array,
    sin: Array,
    attend_fn: AttendFn,
    ctx: ShardingCtx | None,
) -> tuple[Array, Any]:
    """One pre-norm layer: `x + o(attn(rope(qkv(norm(x)))))`, then `x + down(SwiGLU(norm(x)))`,
    with its `PROJECTION_OUTPUTS` named for remat policies.

    Args:
        w: the layer's weights.
        x_BTD: residual stream in the compute dtype.
        cos / sin: RoPE tables [B, T, 1, H/2].
        attend_fn: attention over the new keys and values and whatever cache it reads.
        ctx: activation sharding context.

    Returns:
        (new residual stream, what `attend_fn` returned besides the attention output).
    """
    q_BTNH, k_BTKH, v_BTKH = w.qkv(w.attn_norm(x_BTD))
    q_BTNH = checkpoint_name(shard_act(apply_rope(q_BTNH, cos, sin), HEAD_AXES, ctx), "q")
    k_BTKH = checkpoint_name(shard_act(apply_rope(k_BTKH, cos, sin), KV_AXES, ctx), "k")
    v_BTKH = checkpoint_name(shard_act(v_BTKH, KV_AXES, ctx), "v")
    attn_BTNH, kv = attend_fn(q_BTNH, k_BTKH, v_BTKH)
    attn_BTNH = checkpoint_name(attn_BTNH, "attention")
    x_BTD = checkpoint_name(x_BTD + w.o(attn_BTNH).astype(x_BTD.dtype), "mid_residual")
    gate_BTF, up_BTF = w.gate_up(w.mlp_norm(x_BTD))
    gate_BTF, up_BTF = checkpoint_name(gate_BTF, "gate"), checkpoint_name(up_BTF, "up")
    act_BTF = shard_act(jax.nn.silu(gate_BTF) * up_BTF, MLP_AXES, ctx)
    x_BTD = x_BTD + w.down(act_BTF).astype(x_BTD.dtype)
    return shard_act(x_BTD, X_AXES, ctx), kv
