"""Building blocks of the decoder: projections with logical axes, RMSNorm, RoPE, attention.

Every parameter is an `nnx.Param` whose `logical_axes` metadata names each dimension from the
vocabulary in `jaxgrpo.sharding` (embed, heads, kv_heads, head_dim, mlp, vocab, layers,
lora_rank). We keep our own metadata key rather than flax's `out_sharding`: flax shards such
variables eagerly against a global mesh, and jaxgrpo passes its mesh explicitly instead.

Parameters may carry leading "stack" dimensions (the L axis of the scanned decoder); the modules
are written for one layer and are called on per-layer slices inside `jax.lax.scan`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.lora import LoRA
from jaxgrpo.types import Array

# Finite instead of -inf so a query row with no visible key (a left-pad position) gives uniform
# attention (finite garbage) rather than NaN, which would poison gradients through the mask.
_MASK_VALUE = -1e30


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
        if (self.platform or jax.default_backend()) == "cpu":
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
    the kernel's gradient formed as `x^T dy`, directly in the kernel's [in, out] layout. Used
    on XLA:CPU only: compiled for TPU it moved about 5% more bytes than plain autodiff in a
    full fine-tuning update (see `python -m jaxgrpo.compile`).

    Autodiff of a projection forms it as `dy^T x` [out, in] and then transposes it, and
    XLA:CPU's dot also copies dy into [out, rows] order first. In a full fine-tuning update of
    the issue-5 workload (`benchmarks/grpo_step.py`) those copies, two per projection per
    layer, were the largest non-matmul cost. Written as `x^T dy`, only x (the narrower
    [rows, in] operand for the MLP's up-projections) is transposed.

    The saved values are x and the kernel exactly as passed (not reshaped), so a layer scan
    reuses its per-layer weight slices in the backward pass instead of stacking a copy of them
    (a reshaped kernel cost a LoRA update 0.5 GB more temporary memory).
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


def attend(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, mask_BTS: Array) -> Array:
    """Grouped-query softmax attention; scores and softmax in float32.

    Args:
        q_BTNH: queries, N = K * M (M query heads share each kv head).
        k_BSKH / v_BSKH: keys and values.
        mask_BTS: True where query t may attend key s.

    Returns:
        [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q_BTNH.shape
    k = k_BSKH.shape[2]
    q_BTKMH = q_BTNH.reshape(b, t, k, n // k, h)
    scores = jnp.einsum(
        "BTKMH,BSKH->BKMTS",
        q_BTKMH,
        k_BSKH.astype(q_BTNH.dtype),
        preferred_element_type=jnp.float32,
    ) * (1.0 / math.sqrt(h))
    probs = _masked_softmax(scores, mask_BTS).astype(q_BTNH.dtype)
    out = jnp.einsum("BKMTS,BSKH->BTKMH", probs, v_BSKH.astype(q_BTNH.dtype))
    return out.reshape(b, t, n, h)


def attend_shared_prompt(
    q_RTNH: Array,
    prompt_kv: tuple[Array, Array],
    prompt_mask_BP: Array,
    kv: tuple[Array, Array],
    mask_RTS: Array,
) -> Array:
    """`attend` for the decode cache: a prompt part shared by each group of rows, then each
    row's own completion slots, both stored heads-first.

    Rows r = b*G .. b*G+G-1 are the G samples of prompt b (R = B * G). The prompt's keys and
    values are stored once per prompt, so its scores are one matmul per (prompt, kv head)
    with the G * M * T queries of the group as rows, reading the prompt cache once per group
    instead of once per row. One softmax runs over the prompt and completion slots together.

    Args:
        q_RTNH: queries, N = K * M.
        prompt_kv: keys [B, K, H, P] and values [B, K, P, H] of the prompts.
        prompt_mask_BP: True at real (non-pad) prompt slots; every query may attend them.
        kv: keys [R, K, H, S] and values [R, K, S, H] of the completion slots.
        mask_RTS: True where query t may attend completion slot s.

    Returns:
        [R, T, N, H] in q's dtype.
    """
    r, t, n, h = q_RTNH.shape
    (pk_BKHP, pv_BKPH), (k_RKHS, v_RKSH) = prompt_kv, kv
    b, k, p, _ = pv_BKPH.shape
    g, m, dtype = r // b, n // k, q_RTNH.dtype
    scale = 1.0 / math.sqrt(h)
    # Prompt part: the group's queries as rows X = G * M * T of one matmul per (b, k).
    q_BKXH = q_RTNH.reshape(b, g, t, k, m, h).transpose(0, 3, 1, 4, 2, 5).reshape(b, k, -1, h)
    prompt_BKXP = jnp.einsum(
        "BKXH,BKHP->BKXP", q_BKXH, pk_BKHP.astype(dtype), preferred_element_type=jnp.float32
    )
    prompt_RKMTP = (
        prompt_BKXP.reshape(b, k, g, m, t, p).transpose(0, 2, 1, 3, 4, 5).reshape(r, k, m, t, p)
    )
    q_RKMTH = q_RTNH.reshape(r, t, k, m, h).transpose(0, 2, 3, 1, 4)
    own_RKMTS = jnp.einsum(
        "RKMTH,RKHS->RKMTS", q_RKMTH, k_RKHS.astype(dtype), preferred_element_type=jnp.float32
    )
    scores = jnp.concatenate([prompt_RKMTP, own_RKMTS], axis=-1) * scale
    prompt_mask_RTP = jnp.broadcast_to(jnp.repeat(prompt_mask_BP, g, axis=0)[:, None, :], (r, t, p))
    probs = _masked_softmax(scores, jnp.concatenate([prompt_mask_RTP, mask_RTS], axis=-1))
    probs = probs.astype(dtype)
    probs_BKXP = (
        probs[..., :p].reshape(b, g, k, m, t, p).transpose(0, 2, 1, 3, 4, 5).reshape(b, k, -1, p)
    )
    out_BKXH = jnp.einsum("BKXP,BKPH->BKXH", probs_BKXP, pv_BKPH.astype(dtype))
    out_RKMTH = out_BKXH.reshape(b, k, g, m, t, h).transpose(0, 2, 1, 3, 4, 5)
    out_RKMTH = out_RKMTH.reshape(r, k, m, t, h) + jnp.einsum(
        "RKMTS,RKSH->RKMTH", probs[..., p:], v_RKSH.astype(dtype)
    )
    return out_RKMTH.transpose(0, 3, 1, 2, 4).reshape(r, t, n, h)


def _masked_softmax(scores_BKMTS: Array, mask_BTS: Array) -> Array:
    """float32 softmax over key slots, with masked slots at a large negative score."""
    scores_BKMTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BKMTS, _MASK_VALUE)
    return jax.nn.softmax(scores_BKMTS, axis=-1)
