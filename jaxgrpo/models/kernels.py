"""The kernels whose best formulation depends on the compiler: each portable reference (JAX's
autodiff of the plain math) beside the variants written for one backend, and the table a
`jaxgrpo.models.layout.Layout` picks from by name.

A variant computes the same values and gradients as its reference (tests/models/test_kernels.py
checks both); only the program differs. The run's builder resolves which one a run uses, once
(`Layout.for_platform`); model code looks its kernels up by the layout's names in
`PROJECTIONS`, `ATTENTIONS` and `SUMS_OF_SQUARES` and never asks which backend it runs on. A
TPU Pallas kernel would join here as one more name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrpo.core.shapes import Array

# Finite instead of -inf so a query row with no visible key (a left-pad position) gives uniform
# attention (finite garbage) rather than NaN, which would poison gradients through the mask.
MASK_VALUE = -1e30

# ---------------------------------------------------------------------------------------------
# Projections: y[..., *out] = sum_in x[..., *in] W[*in, *out].


def project(x: Array, kernel: Array, n_in: int) -> Array:
    """The reference projection: `tensordot(x, kernel, n_in)`, differentiated by autodiff."""
    return jnp.tensordot(x, kernel, axes=n_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project_xla_cpu(x: Array, kernel: Array, n_in: int) -> Array:
    """`tensordot(x, kernel, n_in)`: x [..., *in] and kernel [*in, *out] -> [..., *out], with
    the kernel's gradient formed as `x^T dy`, directly in the kernel's [in, out] layout.
    XLA:CPU's variant of `project` (on TPU plain autodiff moves fewer bytes).

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


project_xla_cpu.defvjp(_project_fwd, _project_bwd)

PROJECTIONS: dict[str, Callable[[Array, Array, int], Array]] = {
    "jax": project,
    "xla_cpu": project_xla_cpu,
}

# ---------------------------------------------------------------------------------------------
# Attention: the softmax over keys on queries [R, K, M, T, H] (see `layers.attend`).


class Groups:
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


def softmax_attention(q_RKMTH, k, v, mask_RTS, prompt, heads_first):
    """`attend`'s arithmetic on queries [R, K, M, T, H]: (the output [R, K, M, T, H] in
    float32, and the unnormalised weights of the own keys and of the prompt's, and their
    total [R, K, M, T], which `attention_xla_cpu`'s backward reuses)."""
    r, kh, m, t, h = q_RKMTH.shape
    dtype, f32 = q_RKMTH.dtype, jnp.float32
    scale = 1.0 / math.sqrt(h)
    scores_RKMTS = jnp.einsum(
        "RKMTH,RKHS->RKMTS" if heads_first else "RKMTH,RSKH->RKMTS",
        q_RKMTH,
        k.astype(dtype),
        preferred_element_type=f32,
    )
    scores_RKMTS = jnp.where(mask_RTS[:, None, None], scores_RKMTS * scale, MASK_VALUE)
    peak_RKMT = jnp.max(scores_RKMTS, axis=-1)
    if prompt is not None:
        pk_BKHP, pv_BKPH, prompt_mask_BP = prompt
        groups = Groups(r, prompt_mask_BP.shape[0], kh, m, t)
        prompt_BKXP = jnp.einsum(
            "BKXH,BKHP->BKXP",
            groups.to_prompts(q_RKMTH),
            pk_BKHP.astype(dtype),
            preferred_element_type=f32,
        )
        prompt_BKXP = jnp.where(prompt_mask_BP[:, None, None], prompt_BKXP * scale, MASK_VALUE)
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
def attention_xla_cpu(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt):
    """`softmax_attention` in the heads-first layout, with a backward pass whose dots all read
    their operands as XLA:CPU's matmul wants them ([rows, contracted] x [contracted or free
    minor]): the large score-shaped arrays are never transposed, only the narrow [T, H] ones.
    Autodiff instead copies the probabilities transposed and runs one of the dots outside
    YNNPACK (benchmarks/README.md, "The attention backward on CPU"). Its residuals are the forward's
    unnormalised weights, their totals and the output, so the backward pass recomputes neither
    the scores nor the output."""
    return softmax_attention(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, True)[0]


def _attention_xla_cpu_fwd(q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt):
    out_RKMTH, (weights_RKMTS, weights_BKXP, total_RKMT) = softmax_attention(
        q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, True
    )
    saved = (q_RKMTH, k_RKHS, v_RKSH, mask_RTS, prompt, out_RKMTH)
    return out_RKMTH, (saved, weights_RKMTS, weights_BKXP, total_RKMT)


def _attention_xla_cpu_bwd(residuals, dout_RKMTH):
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
        groups = Groups(r, prompt_mask_BP.shape[0], kh, m, t)
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


attention_xla_cpu.defvjp(_attention_xla_cpu_fwd, _attention_xla_cpu_bwd)


def attention_jax(q_RKMTH, k, v, mask_RTS, prompt, heads_first):
    """The reference attention: `softmax_attention`'s output, differentiated by autodiff."""
    return softmax_attention(q_RKMTH, k, v, mask_RTS, prompt, heads_first)[0]


def attention_on_xla_cpu(q_RKMTH, k, v, mask_RTS, prompt, heads_first):
    """`attention_xla_cpu` in the heads-first layout (the decode cache's and the packed
    bands'), which its backward is written for; the reference otherwise."""
    if heads_first:
        return attention_xla_cpu(q_RKMTH, k, v, mask_RTS, prompt)
    return attention_jax(q_RKMTH, k, v, mask_RTS, prompt, heads_first)


# Each: (q [R, K, M, T, H], k, v, mask, prompt, heads_first) -> the output [R, K, M, T, H] (f32).
ATTENTIONS: dict[str, Callable] = {"jax": attention_jax, "xla_cpu": attention_on_xla_cpu}

# ---------------------------------------------------------------------------------------------
# Sums of squares (the gradient's global norm).


def sum_of_squares(x: Array) -> Array:
    """The reference: `sum(x ** 2)` in float32."""
    x = x.astype(jnp.float32)
    return jnp.sum(x * x)


# Arrays up to this many elements are reduced by `jnp.sum` directly.
_SMALL_REDUCTION = 1 << 16


def sum_of_squares_xla_cpu(x: Array) -> Array:
    """`sum(x ** 2)` in float32, added up slice by slice along the leading axis first.

    XLA:CPU turns a reduction over a large array into a chain of 32-element windowed
    reductions, far below memory speed. Adding the k slices of the leading axis elementwise
    (one fused loop, vectorised) runs at memory speed and leaves an array k times smaller; this
    repeats down to a small array, which `jnp.sum` finishes (figures in benchmarks/README.md,
    "The gradient norm"). Only leading axes are split, so every other axis keeps its
    sharding. The rounding differs from `jnp.sum` only in the order of the additions.
    """
    x, squared = x.astype(jnp.float32), False
    while x.size > _SMALL_REDUCTION and x.ndim > 1:
        lead = x.shape[0]
        k = max(d for d in range(1, min(lead, 64) + 1) if lead % d == 0)
        if k == 1:
            break
        parts = list(x.reshape(k, lead // k, *x.shape[1:]))
        if not squared:  # squared inside the first level's fused loop: one pass over x
            parts, squared = [p * p for p in parts], True
        x = sum(parts[1:], parts[0])
        if x.shape[0] == 1:
            x = x[0]
    return jnp.sum(x) if squared else jnp.sum(x * x)


SUMS_OF_SQUARES: dict[str, Callable[[Array], Array]] = {
    "jax": sum_of_squares,
    "xla_cpu": sum_of_squares_xla_cpu,
}
