"""Low-rank adaptation (LoRA) of the decoder's projections.

How it works. LoRA (Hu et al., 2021) freezes a projection W [in, out] and learns a low-rank
update, so the layer computes `x W + (alpha / r) (x A) B` with A [in, r] and B [r, out]. B
starts at zero, so an untrained adapter reproduces the base model exactly; A starts random so
the first gradient on B is informative.

Declared, not intercepted. Adapters are created at construction from `ModelConfig.lora` as
child modules of the projections they adapt (`Einsum.lora` in `layers.py`), so the module graph
is the same under jit, `lax.scan` over layers and remat; nothing swaps layers at call time.
Their weights are `nnx.LoRAParam`, a subclass of `nnx.Param`, which is what makes the split
work with one filter (order matters: LoRAParam must come first because it is also a Param):

    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
    loss(nnx.merge(graphdef, lora, base))   # differentiate w.r.t. `lora` only

The base weights are then a constant of the training step and are never copied for the
reference policy: `zero_lora(lora)` returns adapters with B = 0, and
`nnx.merge(graphdef, zero_lora(lora), base)` is the base model, sharing `base`'s buffers.

Multi-dim projections. Our kernels keep heads explicit (q is [D, N, H]), so A is [*in, r] and
B is [r, *out]; both carry the base kernel's logical axes plus a replicated `lora_rank`.
Stacked layers add a leading L axis to A and B exactly as to the kernel. The fused gate+up
kernel [D, 2, F] gets two independent adapters (`MLP.gate_lora`, `MLP.up_lora`) so exports stay
PEFT-compatible.

Merging and export. `merge(model)` folds `scale * A B` into each kernel in place and zeroes
B, keeping the graph (and so every compiled function's signature) unchanged. PEFT names map as
`...layers.{i}.self_attn.q_proj.lora_A.weight` = A[i] reshaped to [r, in] (transposed), and
`lora_B.weight` = B[i] as [out, r]; see `jaxgrpo.models.weights.peft_lora_tensors`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.models.config import LoRAConfig


class LoRA(nnx.Module):
    """The adapter of one projection: `delta(x) = scale * (x A) B`.

    Args:
        in_shape / out_shape: the adapted projection's contracted and produced dims.
        in_axes / out_axes: their logical names.
        cfg: rank, alpha and targets.
        stack: leading stacked dims (e.g. (L,)).
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        cfg: LoRAConfig,
        *,
        stack: tuple[int, ...] = (),
        param_dtype: str = "float32",
        rngs: nnx.Rngs,
    ):
        stack_axes = ("layers",) * len(stack)
        r = cfg.rank
        # Kaiming-style scale on A (PEFT uses kaiming_uniform); B is zero so delta starts at 0.
        a = jax.random.normal(rngs.params(), (*stack, *in_shape, r), jnp.float32)
        self.lora_a = nnx.LoRAParam(
            (a / math.sqrt(math.prod(in_shape))).astype(param_dtype),
            logical_axes=(*stack_axes, *in_axes, "lora_rank"),
        )
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((*stack, r, *out_shape), param_dtype),
            logical_axes=(*stack_axes, "lora_rank", *out_axes),
        )
        self.n_in = len(in_shape)
        self.n_out = len(out_shape)
        self.scale = cfg.scale

    def __call__(self, x: Array) -> Array:
        """[..., *in] -> [..., *out] in x's dtype."""
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        in_shape, out_shape = a.shape[:-1], b.shape[1:]
        lead = x.shape[: x.ndim - self.n_in]
        y_XO = low_rank_delta(
            x.reshape(-1, math.prod(in_shape)),
            a.reshape(math.prod(in_shape), -1),
            b.reshape(b.shape[0], -1),
            self.scale,
        )
        return y_XO.reshape(*lead, *out_shape)

    def delta_kernel(self) -> Array:
        """`scale * A B` as a kernel [*stack, *in, *out] (float32)."""
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        n_stack = a.ndim - self.n_in - 1
        stack, in_shape = a.shape[:n_stack], a.shape[n_stack:-1]
        out_shape = b.shape[n_stack + 1 :]
        a2 = a.reshape(*stack, math.prod(in_shape), a.shape[-1])
        b2 = b.reshape(*stack, b.shape[n_stack], math.prod(out_shape))
        return (self.scale * jnp.matmul(a2, b2)).reshape(*stack, *in_shape, *out_shape)

    def zero(self) -> None:
        self.lora_b[...] = jnp.zeros_like(self.lora_b[...])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def low_rank_delta(x_XI: Array, a_IA: Array, b_AO: Array, scale: float) -> Array:
    """`scale * (x A) B` on matrices, with a backward pass that never transposes x.

    Autodiff forms dA = x^T g (g = scale * dy B^T), and XLA:CPU's dot then copies x, the
    largest operand, into [in, rows] order once per projection and layer (in a LoRA update of
    the issue-5 workload, the MLP activations' copies alone were the largest non-matmul cost).
    Here dA = (g^T x)^T: only the narrow g [rows, A] and the result [A, in] are transposed.
    """
    return _low_rank_fwd(x_XI, a_IA, b_AO, scale)[0]


def _low_rank_fwd(x_XI, a_IA, b_AO, scale):
    u_XA = (x_XI @ a_IA) * scale
    return u_XA @ b_AO, (x_XI, a_IA, b_AO, u_XA)


def _low_rank_bwd(scale, residuals, dy_XO):
    x_XI, a_IA, b_AO, u_XA = residuals
    db_AO = u_XA.T @ dy_XO
    g_XA = (dy_XO @ b_AO.T) * scale
    da_IA = (g_XA.T @ x_XI).T
    dx_XI = g_XA @ a_IA.T
    return dx_XI, da_IA, db_AO


low_rank_delta.defvjp(_low_rank_fwd, _low_rank_bwd)


def zero_lora(lora_state: PyTree) -> PyTree:
    """Adapters with every B set to zero: the reference (base) policy, no base-weight copy.

    Args:
        lora_state: the `nnx.LoRAParam` state from `nnx.split(model, nnx.LoRAParam, ...)`
            (or any pytree whose B leaves sit under a `lora_b` key).

    Returns:
        The same structure; `lora_b` leaves are zeros, `lora_a` leaves are unchanged.
    """

    def zero_b(path, x):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        return jnp.zeros_like(x) if "lora_b" in names else x

    return jax.tree_util.tree_map_with_path(zero_b, lora_state)


def merge(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base kernel in place and zeroes the adapters' B.

    The module graph is unchanged (adapters stay, contributing zero), so functions compiled for
    the model keep their signatures. Returns the model for chaining.
    """
    for _, node in nnx.iter_graph(model):
        if node is not model and hasattr(node, "merge_lora") and isinstance(node, nnx.Module):
            node.merge_lora()
    return model


def lora_state(model: nnx.Module) -> nnx.State:
    """The model's adapter parameters (`nnx.LoRAParam`) as a State."""
    return nnx.state(model, nnx.LoRAParam)
