"""The optimizer update: its global norm, gradient clipping and non-finite guard.

The norm's sums of squares are kernels (tests/models/test_kernels.py); clipping built on each
must give optax's result (rtol 1e-6).
The update must skip and count a step whose loss or gradient is not finite, leaving parameters
and moments as they were.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrpo.core import sharding
from jaxgrpo.models.kernels import SUMS_OF_SQUARES
from jaxgrpo.rl.train_state import (
    TrainState,
    clip_by_global_norm,
    global_norm,
    make_update_fn,
    opt_state_shardings,
)


@pytest.mark.parametrize("kernel", sorted(SUMS_OF_SQUARES))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_global_norm_is_not_finite_when_one_element_is_not(bad, kernel):
    tree = {"a": np.ones((30, 576, 8), np.float32), "b": np.ones((5,), np.float32)}
    norm = jax.jit(lambda t: global_norm(t, kernel))
    assert np.isfinite(float(norm(tree)))
    tree["a"][17, 300, 5] = bad
    assert not np.isfinite(float(norm(tree)))


@pytest.mark.parametrize("kernel", sorted(SUMS_OF_SQUARES))
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_by_global_norm_equals_optax(max_norm, kernel):
    rng = np.random.default_rng(1)
    grads = {"w": rng.normal(size=(30, 64, 48)), "b": rng.normal(size=(48,))}
    grads = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), grads)
    ours, theirs = clip_by_global_norm(max_norm, kernel), optax.clip_by_global_norm(max_norm)
    assert jax.tree.structure(ours.init(grads)) == jax.tree.structure(theirs.init(grads))
    got, _ = jax.jit(ours.update)(grads, ours.init(grads))
    want, _ = theirs.update(grads, theirs.init(grads))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    clipped = float(optax.tree.norm(got))
    assert clipped == pytest.approx(min(max_norm, float(optax.tree.norm(grads))), rel=1e-5)


def _update_and_state(loss_fn):
    """`make_update_fn` over a one-device mesh, and a fresh state for a [4, 3] weight."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    r = sharding.replicated(mesh)
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10}
    param_sh = {"w": r}
    optimizer = optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-2))
    state_sh = TrainState(
        params=param_sh,
        opt_state=opt_state_shardings(optimizer, params, param_sh),
        step=r,
        rng=r,
        ref_params=None,
        skipped=r,
    )
    update = make_update_fn(
        loss_fn, optimizer, state_sh=state_sh, frozen_sh=r, batch_sh=r, idx_sh=r
    )
    state = TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jnp.zeros((2,), jnp.uint32),
        ref_params=None,
        skipped=jnp.zeros((), jnp.int32),
    )
    return update, state, optimizer


def _loss(scale):
    def loss_fn(params, frozen, batch, idx_M, idx_AM):
        loss = jnp.sum((params["w"] * batch) ** 2) * scale
        return loss, {"w_sum": jnp.sum(params["w"])}

    return loss_fn


def test_update_applies_clipped_adamw():
    update, state, optimizer = _update_and_state(_loss(1.0))
    batch, idx = jnp.full((4, 3), 2.0), jnp.zeros((1, 1), jnp.int32)
    w0 = np.asarray(state.params["w"])
    grads = jax.grad(lambda p: _loss(1.0)(p, None, batch, None, None)[0])(state.params)
    want, _ = optimizer.update(grads, optimizer.init(state.params), state.params)
    want = optax.apply_updates(state.params, want)
    new, metrics = update(state, jnp.zeros(()), batch, idx)
    np.testing.assert_allclose(new.params["w"], want["w"], rtol=1e-6)
    assert not np.allclose(new.params["w"], w0)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-6)
    assert int(new.skipped) == 0 and float(metrics["update_skipped"]) == 0.0


@pytest.mark.parametrize("scale", [np.nan, np.inf])
def test_non_finite_loss_or_gradient_skips_the_update_and_counts_it(scale):
    update, state, _ = _update_and_state(_loss(scale))
    w0 = np.asarray(state.params["w"])
    mu0 = [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]
    batch, idx = jnp.full((4, 3), 2.0), jnp.zeros((1, 1), jnp.int32)
    new, metrics = update(state, jnp.zeros(()), batch, idx)
    np.testing.assert_array_equal(new.params["w"], w0)
    for before, after in zip(mu0, jax.tree.leaves(new.opt_state), strict=True):
        np.testing.assert_array_equal(after, before)
    assert int(new.skipped) == 1
    assert float(metrics["update_skipped"]) == 1.0 and float(metrics["grad_norm"]) == 0.0
