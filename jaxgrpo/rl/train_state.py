"""The learner's state pytree and its jitted, sharded optimizer update.

`TrainState` is everything that changes during training and must survive a restart: the
trainable parameters (the LoRA adapters, or every weight for full fine-tuning), the optax state,
the step counter, the PRNG key, the reference policy's trainable part, and the count of updates
skipped because the loss or a gradient was not finite. The frozen weights (the base model under
LoRA) are not part of it: they never change, so they are passed to every compiled function
separately and never checkpointed twice.

`make_update_fn` builds one compiled program per run: gradient accumulation over micro-batches
(a `lax.scan`, so the number of micro-batches never changes the program size), global-norm
clipping, AdamW, and a finiteness guard that keeps the old parameters and optimizer state when
the loss or the gradient's global norm is NaN or infinite (as it is when any gradient element
is). Its input and output shardings are stated explicitly and the state is donated, so the
update happens in place on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxgrpo.core import sharding
from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.models.kernels import SUMS_OF_SQUARES


@flax.struct.dataclass
class TrainState:
    """Learner state; a pytree, so it is jitted, sharded and checkpointed as one object.

    Attributes:
        params: trainable parameters (an `nnx.State` of `LoRAParam`s, or of every `Param` for
            full fine-tuning).
        opt_state: optax state over `params`.
        step: int32 scalar, completed training steps (one rollout batch each).
        rng: uint32 [2] PRNG key; split once per training step.
        ref_params: the reference policy's trainable part (zero LoRA, a LoRA snapshot after a
            reference reset, or a copy of every weight for full fine-tuning with reference
            resets); None when the run needs no reference log-probs or when it is the initial
            weights (full fine-tuning without resets: `Learner.reference`).
        skipped: int32 scalar, optimizer updates skipped because of a non-finite loss or grad.
    """

    params: PyTree
    opt_state: PyTree
    step: Array
    rng: Array
    ref_params: PyTree
    skipped: Array


def make_schedule(optim_cfg: Any, total_updates: int, updates_per_step: int) -> optax.Schedule:
    """Learning-rate schedule over optimizer updates.

    Args:
        optim_cfg: the config's `optim` section (lr, warmup_steps, schedule).
        total_updates: optimizer updates in the whole run (steps x updates per step).
        updates_per_step: optimizer updates per training step; warmup is given in training
            steps, so it is scaled by this.

    Returns:
        An optax schedule: linear warmup from 0 to `lr`, then cosine decay to 0 at the end of
        the run, or constant.
    """
    warmup = int(optim_cfg.warmup_steps) * updates_per_step
    lr = float(optim_cfg.lr)
    if optim_cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup, decay_steps=max(total_updates, warmup + 1)
        )
    if optim_cfg.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    raise ValueError(f"optim.schedule must be 'cosine' or 'constant', got {optim_cfg.schedule!r}")


def make_optimizer(
    optim_cfg: Any, total_updates: int, updates_per_step: int = 1, grad_norm: str = "jax"
) -> optax.GradientTransformation:
    """AdamW with warmup + cosine/constant schedule and global-norm clipping.

    Args:
        optim_cfg: the config's `optim` section (lr, warmup_steps, schedule, weight_decay, b1,
            b2, eps, max_grad_norm; max_grad_norm <= 0 disables clipping).
        total_updates: optimizer updates in the whole run.
        updates_per_step: optimizer updates per training step.
        grad_norm: the clip's sum-of-squares kernel (the run's `Layout.grad_norm`).

    Returns:
        The optax transformation.
    """
    schedule = make_schedule(optim_cfg, total_updates, updates_per_step)
    adamw = optax.adamw(
        schedule,
        b1=float(optim_cfg.b1),
        b2=float(optim_cfg.b2),
        eps=float(optim_cfg.eps),
        weight_decay=float(optim_cfg.weight_decay),
    )
    if float(optim_cfg.max_grad_norm) > 0:
        return optax.chain(clip_by_global_norm(float(optim_cfg.max_grad_norm), grad_norm), adamw)
    return adamw


def global_norm(tree: PyTree, kernel: str = "jax") -> Array:
    """The L2 norm of every element of every leaf of `tree` (float32 scalar), each leaf's
    sum of squares by the kernel `kernel` (`jaxgrpo.models.kernels.SUMS_OF_SQUARES`).

    Not finite exactly when some element is NaN or infinite, or when the norm itself
    overflows float32 (elements near 1e19): the update's finiteness guard relies on this.
    """
    leaves, squares = jax.tree.leaves(tree), SUMS_OF_SQUARES[kernel]
    return jnp.sqrt(sum(squares(x) for x in leaves)) if leaves else jnp.zeros(())


def clip_by_global_norm(max_norm: float, kernel: str = "jax") -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with `global_norm` (same empty state, same result to a
    rounding): each gradient times one scalar factor. A product, unlike optax's `g / norm`,
    is cheap enough for XLA to fuse into each of Adam's consumers, so no clipped copy of the
    gradients is materialised beside them."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates, kernel)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def opt_state_shardings(optimizer: optax.GradientTransformation, params: PyTree, param_sh: PyTree):
    """Shardings of the optimizer state: moments follow their parameter, the rest replicate.

    Args:
        optimizer: the optax transformation.
        params: the trainable parameters (concrete or abstract).
        param_sh: a pytree of `NamedSharding` matching `params`.

    Returns:
        A pytree of shardings matching `optimizer.init(params)`.
    """
    leaf = jax.tree.leaves(param_sh)[0]
    replicated = sharding.replicated(leaf.mesh)
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, param_sharding: param_sharding,
        abstract,
        param_sh,
        transform_non_params=lambda _: replicated,
    )


def _over_micro_batches(name: str):
    """How a metric's micro-batch values become the update's: the max of ``*_max``, the min
    of ``*_min``, else the mean."""
    return jnp.max if name.endswith("_max") else jnp.min if name.endswith("_min") else jnp.mean


def make_update_fn(
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
    optimizer: optax.GradientTransformation,
    *,
    state_sh: Any,
    frozen_sh: Any,
    batch_sh: Any,
    idx_sh: Any,
    accumulating_loss: bool = False,
    norm_kernel: str = "jax",
) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """Builds the jitted update: accumulate grads over micro-batches, clip, AdamW, guard.

    `loss_fn(params, frozen, batch, idx_M, idx_UM)` returns `(loss, metrics)` for the
    micro-batch of groups `idx_M` drawn from the whole rollout `batch`. It must normalise by the
    whole minibatch `idx_UM` (the losses' global normaliser), so the sum of micro-batch losses
    and gradients equals the full minibatch's and accumulation is exact. With
    `accumulating_loss`, it takes the accumulator as a sixth argument and its gradient comes
    out with the accumulator added (`jaxgrpo.rl.objective.fold_accumulator`), so no
    micro-batch holds its own gradient beside the accumulator.

    Args:
        loss_fn: the micro-batch loss, differentiable in `params`.
        optimizer: the optax transformation.
        state_sh: shardings of the `TrainState`.
        frozen_sh: shardings of the frozen parameters.
        batch_sh: shardings of the rollout batch.
        idx_sh: sharding of the [U, M] group-index array (replicated; metrics use it too).
        accumulating_loss: `loss_fn` adds the accumulator into its own gradient.
        norm_kernel: the gradient norm's sum-of-squares kernel (the run's `Layout.grad_norm`).

    Returns:
        `update(state, frozen, batch, idx_UM) -> (state, metrics)`, jitted with `state`
        donated. idx_UM holds, for each of the U micro-batches (U = grad_accum), the M
        groups it trains on.
        Metrics are averaged over micro-batches, plus `loss` (summed), `grad_norm`,
        and `update_skipped` (0/1).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(params, frozen, batch, idx_UM, carry, idx_M):
        grads_acc, loss_acc = carry
        if accumulating_loss:
            (loss, metrics), grads_acc = grad_fn(params, frozen, batch, idx_M, idx_UM, grads_acc)
        else:
            (loss, metrics), grads = grad_fn(params, frozen, batch, idx_M, idx_UM)
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, loss_acc + loss), metrics

    def gradients(params, frozen, batch, idx_UM):
        if idx_UM.shape[0] == 1:  # one micro-batch: no accumulator to zero-fill and add into
            (loss, metrics), grads = grad_fn(params, frozen, batch, idx_UM[0], idx_UM)
            return grads, loss, metrics
        init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
        (grads, loss), metrics = jax.lax.scan(
            lambda c, i: micro_step(params, frozen, batch, idx_UM, c, i), init, idx_UM
        )
        return grads, loss, {k: _over_micro_batches(k)(v, axis=0) for k, v in metrics.items()}

    def update(state: TrainState, frozen: PyTree, batch: PyTree, idx_UM: Array):
        grads, loss, metrics = gradients(state.params, frozen, batch, idx_UM)
        grad_norm = global_norm(grads, norm_kernel)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply(state):
            updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
            return state.replace(
                params=optax.apply_updates(state.params, updates), opt_state=new_opt
            )

        # A non-finite loss or gradient keeps the old parameters and moments.
        new_state = jax.lax.cond(ok, apply, lambda state: state, state)
        new_state = new_state.replace(skipped=state.skipped + (~ok).astype(jnp.int32))
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["grad_norm"] = jnp.where(ok, grad_norm, 0.0)
        metrics["update_skipped"] = (~ok).astype(jnp.float32)
        return new_state, metrics

    return jax.jit(
        update,
        in_shardings=(state_sh, frozen_sh, batch_sh, idx_sh),
        out_shardings=(state_sh, idx_sh),
        donate_argnums=(0,),
    )
