"""Gradient accumulation inside the backward pass, so no micro-batch holds a second gradient.

Accumulating micro-batch gradients as `acc + grad(loss_u)` keeps two model-sized trees alive
at the end of every backward pass: the accumulator, and the gradient the pass has just built.
For full fine-tuning that is a second copy of the model's weights. The two functions here let
the loss fold the accumulator into its own gradient instead:

- `add_into_gradient(tree, acc)` is the identity whose gradient is the incoming one plus
  `acc`: the sum is formed where the gradient is, one leaf at a time.
- `scan_adding_gradients(body, init, stacked, acc)` is `lax.scan(body, init, stacked)` whose
  backward loop carries `acc` and adds each layer's weight gradient into its slice in place,
  so the stacked layers' gradient is never a buffer of its own.

Both are used by the policy loss when `make_update_fn` accumulates over micro-batches
(`jaxgrpo.rl.objective.make_loss_fn`); the learner does so with unrolled layers or remat: a
layer scan without remat stacks per-layer copies of residuals that JAX's own scan keeps once
(benchmarks/README.md, "Gradients added inside the backward pass").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrpo.core.shapes import PyTree


@jax.custom_vjp
def add_into_gradient(tree: PyTree, acc: PyTree) -> PyTree:
    """`tree` unchanged; its gradient is the incoming gradient plus `acc` (same structure)."""
    del acc
    return tree


def _add_fwd(tree, acc):
    return tree, acc


def _add_bwd(acc, ct):
    return jax.tree.map(jnp.add, ct, acc), None


add_into_gradient.defvjp(_add_fwd, _add_bwd)


def scan_adding_gradients(
    body: Callable[[PyTree, PyTree], PyTree],
    init: PyTree,
    stacked: PyTree,
    acc: PyTree,
    unroll: int = 1,
    remat: bool = False,
) -> PyTree:
    """The final carry of `lax.scan(lambda c, x: (body(c, x), None), init, stacked)`; the
    gradient it passes to `stacked` is `acc` plus the scan's own.

    The backward pass runs the steps in reverse with `acc` as its carry, adding step i's
    gradient into `acc[i]`. With `remat` (the scan of `jax.checkpoint(body)`), the forward
    keeps each step's input carry and the backward recomputes the step's VJP from it, as
    JAX's scan of a checkpointed body does. Otherwise it keeps each step's VJP residuals
    except the step's own weights, which the backward slices from `stacked` again; residuals
    that do not change from step to step (from the masks and positions `body` closes over)
    are then stacked L times, which the remat path avoids: they stay outside its loops.

    Args:
        body: one step, `carry, x_i -> carry`; it may close over values that are not
            differentiated (masks, positions), not over the parameters.
        init: the initial carry.
        stacked: the scanned inputs, each leaf [L, ...] (the stacked layer weights).
        acc: the gradient accumulator for `stacked`, same structure and shapes.
        unroll: `lax.scan`'s unroll; L or more runs both passes as straight-line code.
        remat: recompute each step in the backward pass; pass `body` itself, not
            `jax.checkpoint(body)`, or each step would be computed three times.
    """
    n = jax.tree.leaves(stacked)[0].shape[0]
    if unroll >= n:
        step = jax.checkpoint(body) if remat else body
        return _unrolled_adding_gradients(step, init, stacked, acc)
    if remat:  # keep the step's input carry; rebuild its pullback from it and the weights
        keep = lambda c, x: (body(c, x), c)  # noqa: E731
        pullback = lambda c, x: jax.vjp(body, c, x)[1]  # noqa: E731
        return _scan_adding(body, keep, pullback, init, stacked, acc, unroll)
    static = {}  # how the residuals rebuild a pullback: the same at every step

    def keep(carry, x):
        out, pullback = jax.vjp(body, carry, x)
        kept, static["rebuild"] = _without_weights(pullback, x)
        return out, kept

    def rebuilt(kept, x):
        return _with_weights(kept, static["rebuild"], x)

    return _scan_adding(body, keep, rebuilt, init, stacked, acc, unroll)


def _scan_adding(body, keep, pullback, init, stacked, acc, unroll):
    """The scan of `body` with a custom backward: the forward scan runs `keep(carry, x_i) ->
    (carry, kept_i)`; the backward scan applies `pullback(kept_i, x_i)` to the carry's
    gradient in reverse and adds each step's weight gradient into `acc[i]`."""
    n = jax.tree.leaves(stacked)[0].shape[0]

    @jax.custom_vjp
    def run(init, stacked, acc):
        del acc
        return jax.lax.scan(lambda c, x: (body(c, x), None), init, stacked, unroll=unroll)[0]

    def fwd(init, stacked, acc):
        out, kept = jax.lax.scan(keep, init, stacked, unroll=unroll)
        return out, (kept, stacked, acc)

    def bwd(res, ct_out):
        kept, stacked, acc = res

        def step(carry, xs):
            ct, acc = carry
            kept_i, i = xs
            ct, ct_x = pullback(kept_i, jax.tree.map(lambda w: w[i], stacked))(ct)
            return (ct, _add_at(acc, i, ct_x)), None

        (ct_init, acc), _ = jax.lax.scan(
            step, (ct_out, acc), (kept, jnp.arange(n)), reverse=True, unroll=unroll
        )
        return ct_init, acc, None

    run.defvjp(fwd, bwd)
    return run(init, stacked, acc)


def _unrolled_adding_gradients(body, init, stacked, acc):
    """`scan_adding_gradients` as straight-line code: one VJP per layer, each layer's weight
    gradient added into its static slice of `acc`."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    rebuild = [None] * n  # static: how each layer's residuals rebuild its pullback

    def layer(tree, i):
        return jax.tree.map(lambda w: w[i], tree)

    @jax.custom_vjp
    def run(init, stacked, acc):
        del acc
        carry = init
        for i in range(n):
            carry = body(carry, layer(stacked, i))
        return carry

    def fwd(init, stacked, acc):
        carry, kept = init, []
        for i in range(n):
            x = layer(stacked, i)
            carry, pullback = jax.vjp(body, carry, x)
            kept_i, rebuild[i] = _without_weights(pullback, x)
            kept.append(kept_i)
        return carry, (kept, stacked, acc)

    def bwd(res, ct):
        kept, stacked, acc = res
        for i in reversed(range(n)):
            ct, ct_x = _with_weights(kept[i], rebuild[i], layer(stacked, i))(ct)
            acc = _add_at(acc, i, ct_x)
        return ct, acc, None

    run.defvjp(fwd, bwd)
    return run(init, stacked, acc)


def _without_weights(pullback, x: PyTree) -> tuple[list, tuple]:
    """(residuals, how to rebuild): `pullback`'s residual arrays except those that are the
    step's own weights `x`, which the backward pass slices again from the stacked layers
    rather than keeping a second copy of them."""
    leaves, treedef = jax.tree.flatten(pullback)
    position = {id(w): k for k, w in enumerate(jax.tree.leaves(x))}
    from_x = tuple(position.get(id(r)) for r in leaves)
    return [r for r, k in zip(leaves, from_x, strict=True) if k is None], (treedef, from_x)


def _with_weights(kept: list, rebuild: tuple, x: PyTree):
    """The pullback `_without_weights` took apart, its weights taken from `x`."""
    treedef, from_x = rebuild
    weights, rest = jax.tree.leaves(x), iter(kept)
    return jax.tree.unflatten(treedef, [next(rest) if k is None else weights[k] for k in from_x])


def _add_at(acc: PyTree, i, grad: PyTree) -> PyTree:
    """`acc` with `grad` added into slice i of every leaf."""
    return jax.tree.map(lambda a, g: a.at[i].add(g.astype(a.dtype)), acc, grad)
