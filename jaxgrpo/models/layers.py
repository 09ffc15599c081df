"""Building blocks of the decoder: projections with logical axes, RMSNorm, RoPE, attention.

Every parameter is an `nnx.Param` whose `logical_axes` metadata names each dimension from the
vocabulary in `jaxgrpo.core.sharding` (embed, heads, kv_heads, head_dim, mlp, vocab, layers,
lora_rank). We keep our own metadata key rather than flax's `out_sharding`: flax shards such
variables eagerly against a global mesh, and jaxgrpo passes its mesh explicitly instead.

Parameters may carry leading "stack" dimensions (the L axis of the scanned decoder); the modules
are written for one layer and are called on per-layer slices inside `jax.lax.scan`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxgrpo.core.host import backend
from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx, shard_act
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.lora import LoRA

# Finite instead of -inf so a query row with no visible key (a left-pad position) gives uniform
# attention (finite garbage) rather than NaN, which would poison gradients through the mask.
_MASK_VALUE = -1e30

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
        platform: the backend the model is compiled for ("" = the default backend when
            traced): on "cpu" the projection uses `project`'s hand-written backward.
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
        platform: str = "",
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
        self.platform = platform

    def __call__(self, x: Array) -> Array:
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        if backend(self.platform) == "cpu":
            y = project(x, kernel, self.n_in)
        else:  # XLA:TPU/GPU lay the plain backward out better (fewer bytes moved)
            y = jnp.tensordot(x, kernel, axes=self.n_in)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x: Array, kernel: Array, n_in: int) -> Array:
    """`tensordot(x, kernel, n_in)`: x [..., *in] and kernel [*in, *out] -> [..., *out], with
    the kernel's gradient formed as `x^T dy`, directly in the kernel's [in, out] layout.
    Used on XLA:CPU only (for TPU plain autodiff moves fewer bytes).

    Autodiff of a projection forms it as `dy^T x` [out, in] and then transposes it, and
    XLA:CPU's dot also copies dy into [out, rows] order first: two copies per projection per
    layer, the largest non-matmul cost of a CPU fine-tuning update. Written as `x^T dy`, only x
    (the narrower [rows, in] operand for the MLP's up-projections) is transposed. The saved
    values are x and the kernel exactly as passed (not reshaped), so a layer scan reuses its
    per-layer weight slices in the backward pass instead of stacking a copy of them. Figures:
    benchmarks/README.md, "Projection weight gradients".
    """
    return jnp.tensordot(x, kernel, axes=n_in)


def _project_fwd(x, kernel, n_in):
    return jnp.tensordot(x, kernel, axes=n_in), (x, kernel)


def _project_bwd(n_in, residuals, dy):
    x, kernel = residuals
    n_features = math.prod(kernel.shape[:n_in])
    x_XI, w_IO = x.reshape(-1, n_features), kernel.reshape(n_features, -1)
    dy_XO = dy.reshape(x_XI.shape[0], -1)
    dx_XI = jnp.einsum("XO,IO->XI", dy_XO, w_IO)
    dw_IO = jnp.einsum("XI,XO->IO", x_XI, dy_XO)
    return dx_XI.reshape(x.shape), dw_IO.reshape(kernel.shape)


project.defvjp(_project_fwd, _project_bwd)


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
    platform: str = "",
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
        platform: the backend compiled for ("" = the default backend): on "cpu" the
            heads-first layout differentiates through `_attention_cpu`'s hand-written backward.

    Returns:
        [R, T, N, H] in q's dtype.
    """
    r, t, n, h = q_RTNH.shape
    kh = k.shape[1 if heads_first else 2]
    q_RKMTH = q_RTNH.reshape(r, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    if heads_first and backend(platform) == "cpu":
        out_RKMTH = _attention_cpu(q_RKMTH, k, v, mask_RTS, prompt)
    else:
        out_RKMTH = _softmax_attention(q_RKMTH, k, v, mask_RTS, prompt, heads_first)[0]
    return out_RKMTH.transpose(0, 3, 1, 2, 4).reshape(r, t, n, h).astype(q_RTNH.dtype)


class _Groups:
    """Moves per-row arrays [R, K, M, T, ...] to the prompts' layout [B, K, G * M * T, ...]
    and back, for R = B * G rows: the prompt's scores have a group's queries as matmul rows."""

    def __init__(self, rows: int, prompts: int, kv_heads: int, m: int, t: int):
        self.r, self.b, self.kh, self.m, self.t = rows, prompts, kv_heads, m, t
        self.g = rows // prompts

    def to_prompts(self, x_RKMT: Array) -> Array:
        rest = x_RKMT.shape[4:]
        x = x_RKMT.reshape(self.b, self.g, self.kh, self.m, self.t, *rest).swapaxes(1, 2)
        return x.reshape(self.b, self.kh, -1, *rest)

    def to_rows(self, x_BKX: Array) -> Array:
        rest = x_BKX.shape[3:]
        x = x_BKX.reshape(self.b, self.kh, self.g, self.m, self.t, *rest).swapaxes(1, 2)
        return x.reshape(self.r, self.kh, self.m, self.t, *rest)


def _softmax_attention(q_RKMTH, k, v, mask_RTS, prompt, heads_first):
    """`attend`'s arithmetic on queries [R, K, M, T, H]: (the output [R, K, M, T, H] in
    float32, and the unnormalised weights of the own keys and of the prompt's, and their
    total [R, K, M, T], which `_attention_cpu`'s backward reuses)."""
    r, kh, m, t, h = q_RKMTH.shape
    dtype, f32 = q_RKMTH.dtype, jnp.float32
    scale = 1.0 / math.sqrt(h)
    scores_RKMTS = jnp.einsum(
        "RKMTH,RKHS->RKMTS" if heads_first else "RKMTH,RSKH->RKMTS",
        q_RKMTH,
        k.astype(dtype),
        preferred_element_type=f32,
    )
    scores_RKMTS = jnp.where(mask_RTS[:, None, None], scores_RKMTS * scale, _MASK_VALUE)
    peak_RKMT = jnp.max(scores_RKMTS, axis=-1)
    if prompt is not None:
        pk_BKHP, pv_BKPH, prompt_mask_BP = prompt
        groups = _Groups(r, prompt_mask_BP.shape[0], kh, m, t)
        prompt_BKXP = jnp.einsum(
            "BKXH,BKHP->BKXP",
            groups.to_prompts(q_RKMTH),
            pk_BKHP.astype(dtype),
            preferred_element_type=f32,
        )
        prompt_BKXP = jnp.where(prompt_mask_BP[:, None, None], prompt_BKXP * scale, _MASK_VALUE)
        peak_RKMT = jnp.maximum(peak_RKMT, groups.to_rows(jnp.max(prompt_BKXP, axis=-1)))
    # Any common shift leaves the softmax unchanged: the maximum is a constant to autodiff.
    peak_RKMT = jax.lax.stop_gradient(peak_RKMT)
    weights_RKMTS = jnp.exp(scores_RKMTS - peak_RKMT[..., None])
    total_RKMT = jnp.sum(weights_RKMTS, axis=-1)
    out_RKMTH = jnp.einsum(
        "RKMTS,RKSH->RKMTH" if heads_first else "RKMTS,RSKH->RKMTH",
        weights_RKMTS.astype(dtype),
        v.astype(dtype),
        preferred_element_type=f32,
    )
    weights_BKXP = None
    if prompt is not None:
        weights_BKXP = jnp.exp(prompt_BKXP - groups.to_prompts(peak_RKMT)[..., None])
        total_RKMT = total_RKMT + groups.to_rows(jnp.sum(weights_BKXP, axis=-1))
        out_BKXH = jnp.einsum(
            "BKXP,BKPH->BKXH",
            weights_BKXP.astype(dtype),
            pv_BKPH.astype(dtype),
            preferred_element_type=f32,
        )
        out_RKMTH = out_RKMTH + groups.to_rows(out_BKXH)
    out_RKMTH = out_RKMTH / total_RKMT[..., None]
    return out_RKMTH, (weights_RKMTS, weights_BKXP, total_RKMT)


@jax.custom_vjp
def _attention_cpu(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt):
    """`_softmax_attention` in the heads-first layout, with a backward pass whose dots all read
    their operands as XLA:CPU's matmul wants them ([rows, contracted] x [contracted or free
    minor]): the large score-shaped arrays are never transposed, only the narrow [T, H] ones.
    Autodiff instead copies the probabilities transposed and runs one of the dots outside
    YNNPACK (benchmarks/README.md, "The attention backward on CPU"). Its residuals are the forward's
    unnormalised weights, their totals and the output, so the backward pass recomputes neither
    the scores nor the output."""
    return _softmax_attention(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, True)[0]


def _attention_cpu_fwd(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt):
    out_RKMTH, (weights_RKMTS, weights_BKXP, total_RKMT) = _softmax_attention(
        q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, True
    )
    saved = (q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, out_RKMTH)
    return out_RKMTH, (saved, weights_RKMTS, weights_BKXP, total_RKMT)


def _attention_cpu_bwd(residuals, dout_RKMTH):
    """With p = w / total the probabilities and o the output: dv = p^T do, and the scores'
    gradient ds = p (do v^T - rowsum(do o)) (zero where masked), then dq = ds k, dk = ds^T q,
    times the score scale. Each transposed product is formed in the key layout [K, H, S]
    as do^T p and q^T ds."""
    (q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, out_RKMTH), weights_RKMTS, weights_BKXP, total = (
        residuals
    )
    r, kh, m, t, h = q_RKMTH.shape
    dtype, f32 = q_RKMTH.dtype, jnp.float32
    scale = 1.0 / math.sqrt(h)
    # do / total and rowsum(do o) / total: the unnormalised weights then stand in for p.
    dos_RKMTH = dout_RKMTH.astype(f32) / total[..., None]
    shift_RKMT = jnp.sum(dos_RKMTH * out_RKMTH, axis=-1)

    def dots(batch, rows, keys, q, dos, shift, weights, mask, k, v):
        """One part's gradients: queries [*batch, *rows, H], keys [*batch, H, keys], values
        [*batch, keys, H]; returns dq and the keys' and values' gradients in their layouts."""
        qh, ws, hs = f"{batch}{rows}H", f"{batch}{rows}{keys}", f"{batch}H{keys}"
        kw = dict(preferred_element_type=f32)
        grad_v = jnp.einsum(f"{qh},{ws}->{hs}", dos.astype(dtype), weights.astype(dtype), **kw)
        dp = jnp.einsum(f"{qh},{batch}{keys}H->{ws}", dos.astype(dtype), v.astype(dtype), **kw)
        ds = jnp.where(mask, weights * (dp - shift[..., None]) * scale, 0.0).astype(dtype)
        dq = jnp.einsum(f"{ws},{hs}->{qh}", ds, k.astype(dtype), **kw)
        grad_k = jnp.einsum(f"{qh},{ws}->{hs}", q, ds, **kw)
        return dq, grad_k, jnp.swapaxes(grad_v, -1, -2)

    dq_RKMTH, dk, dv = dots(
        "RK",
        "MT",
        "S",
        q_RKMTH,
        dos_RKMTH,
        shift_RKMT,
        weights_RKMTS,
        mask_RTS[:, None, None],
        k_RKHS,
        v_RKSH,
    )
    dprompt = None
    if prompt is not None:
        pk_BKHP, pv_BKPH, prompt_mask_BP = prompt
        groups = _Groups(r, prompt_mask_BP.shape[0], kh, m, t)
        dq_BKXH, dpk, dpv = dots(
            "BK",
            "X",
            "P",
            groups.to_prompts(q_RKMTH),
            groups.to_prompts(dos_RKMTH),
            groups.to_prompts(shift_RKMT),
            weights_BKXP,
            prompt_mask_BP[:, None, None],
            pk_BKHP,
            pv_BKPH,
        )
        dq_RKMTH = dq_RKMTH + groups.to_rows(dq_BKXH)
        dprompt = (dpk.astype(pk_BKHP.dtype), dpv.astype(pv_BKPH.dtype), None)
    return (
        dq_RKMTH.astype(dtype),
        dk.astype(k_RKHS.dtype),
        dv.astype(v_RKSH.dtype),
        None,
        dprompt,
    )


_attention_cpu.defvjp(_attention_cpu_fwd, _attention_cpu_bwd)


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
    platform: str = "",
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
        platform=platform,
    )
    return out.reshape(b, cols, n, h)


class LayerWeights(Protocol):
    """One decoder layer's weights, as the operations `decoder_layer` applies.

    Implemented by `transformer.Block` (training layout, LoRA unmerged) and by the decode
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
