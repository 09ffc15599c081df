"""Gradient accumulation inside the backward pass (`jaxgrpo.models.accumulate`): the gradient
comes out with the accumulator added, equal to the plain gradient plus it, and the layers'
share costs no second gradient buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models.accumulate import add_into_gradient
from jaxgrpo.models.layout import Layout
from jaxgrpo.models.tiny import tiny_model_config
from jaxgrpo.models.transformer import Segment, Transformer


def _accumulator(tree, seed):
    """A random tree shaped like `tree` (a stand-in for earlier micro-batches' gradients)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


def test_add_into_gradient_adds_the_accumulator():
    """The identity whose gradient is the incoming one plus `acc` (exact in float32)."""
    x = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4)}
    acc = _accumulator(x, 0)

    def f(x):
        return jnp.sum(jnp.sin(x["a"])) + jnp.sum(x["b"] ** 2)

    plain = jax.grad(f)(x)
    folded = jax.grad(lambda x: f(add_into_gradient(x, acc)))(x)
    for key in x:
        np.testing.assert_array_equal(folded[key], plain[key] + acc[key])


def _loss(model, ids, weight, layer_grad_acc=None):
    """A scalar of two segments' hidden states (the second attending the first)."""
    b, t = ids.shape
    split = t // 2
    tail = t - split
    causal = jnp.tril(jnp.ones((tail, tail), jnp.bool_))
    attention = jnp.concatenate(
        [jnp.ones((b, tail, split), jnp.bool_), jnp.broadcast_to(causal, (b, tail, tail))], axis=2
    )
    positions = jnp.broadcast_to(split + jnp.arange(tail), (b, tail))
    head = Segment(ids[:, :split], None)
    rest = Segment(ids[:, split:], None, positions, attention, prefix=(0,))
    h_head, h_rest = model.forward_segments([head, rest], layer_grad_acc)
    return jnp.sum(h_head * weight[:, :split]) + jnp.sum(h_rest * weight[:, split:])


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"layout": Layout(layer_loop="unroll")},
        {"remat": True},
        {"remat": True, "remat_policy": "projections"},
    ],
    ids=["scan", "unrolled", "remat", "remat_projections"],
)
def test_layer_scan_adds_the_accumulator_into_the_layers_gradient(layout):
    """With `layer_grad_acc`, the stacked layers' gradient is the plain one plus the
    accumulator (float32, 1e-5) and every other weight's gradient is unchanged; forward
    values are identical."""
    cfg = tiny_model_config().replace(**layout)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    weight = jax.random.normal(jax.random.key(2), (2, 12, cfg.hidden_size))
    acc = _accumulator(params["layers"], 3)

    @jax.jit
    def grads(params, acc):
        def loss(params):
            return _loss(nnx.merge(graphdef, params), ids, weight, acc)

        return jax.value_and_grad(loss)(params)

    value, got = grads(params, acc)
    want_value, want = grads(params, None)
    assert float(value) == float(want_value)
    for key in ("embed", "final_norm", "lm_head"):
        for g, w in zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key]), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=key)
    summed = jax.tree.map(jnp.add, want["layers"], acc)
    paths = jax.tree_util.tree_leaves_with_path(got["layers"])
    for (path, g), w in zip(paths, jax.tree.leaves(summed), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))


# The CPU trainer's layout (its kernels), whose buffers the next test measures on XLA:CPU.
CPU_SCAN = Layout.for_platform("cpu", layer_loop="scan")
CPU_UNROLL = Layout.for_platform("cpu", layer_loop="unroll")


@pytest.mark.parametrize(
    "layout, share",
    [
        ({"layout": CPU_SCAN}, 0.9),
        ({"layout": CPU_UNROLL}, 0.6),
        ({"layout": CPU_SCAN, "remat": True}, 0.9),
    ],
    ids=["scan", "unrolled", "remat"],
)
def test_layer_scan_needs_no_second_buffer_for_the_layers_gradient(layout, share):
    """Compiled, `acc + grad` needs a temporary as large as the stacked layers (their fresh
    gradient); adding into `acc` inside the backward loop needs at least `share` of that less
    (XLA's buffer assignment, `memory_analysis`). Wide layers and 16 tokens, so the weights
    and not the activations set the size. Unrolled, XLA:CPU's scheduler computes some layers'
    weight gradients before the sums they go into (0.68 of the layers saved here)."""
    cfg = tiny_model_config().replace(hidden_size=256, intermediate_size=1024, **layout)
    cfg = cfg.replace(num_layers=4, head_dim=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    weight = jax.random.normal(jax.random.key(2), (2, 8, cfg.hidden_size))

    def plain(params, acc):
        g = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), ids, weight))(params)
        return jax.tree.map(jnp.add, acc, g["layers"])

    def folded(params, acc):
        return jax.grad(lambda p: _loss(nnx.merge(graphdef, p), ids, weight, acc))(params)["layers"]

    def temp_bytes(fn):
        compiled = jax.jit(fn, donate_argnums=1).lower(params, params["layers"]).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    layers = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    saved = temp_bytes(plain) - temp_bytes(folded)
    assert saved >= share * layers, (saved, layers)


def test_remat_layer_scan_keeps_what_the_body_closes_over_once():
    """With `remat`, the forward keeps each step's input carry and nothing else: a large value
    the body closes over (here a [512, 512] matrix, as the attention masks are in the model)
    stays outside the loops, as in JAX's scan of a checkpointed body, where the residual path
    stacks a copy per step. Same gradient: the plain one plus the accumulator (1e-5)."""
    from jaxgrpo.models.accumulate import scan_adding_gradients

    steps, n, d = 8, 512, 16
    keys = jax.random.split(jax.random.key(0), 4)
    big = jax.random.normal(keys[0], (n, n)) / n
    w = jax.random.normal(keys[1], (steps, d, d)) / d
    x0 = jax.random.normal(keys[2], (n, d))
    acc = jax.random.normal(keys[3], w.shape)

    def body(big):
        return lambda c, w_i: jnp.tanh(big @ c @ w_i)

    def plain(w, big, acc):
        def loss(w):
            step = jax.checkpoint(body(big))
            return jnp.sum(jax.lax.scan(lambda c, x: (step(c, x), None), x0, w)[0] ** 2)

        return jax.grad(loss)(w) + acc

    def folded(remat):
        def grad(w, big, acc):
            step = body(big) if remat else jax.checkpoint(body(big))
            loss = lambda w: jnp.sum(scan_adding_gradients(step, x0, w, acc, remat=remat) ** 2)  # noqa: E731
            return jax.grad(loss)(w)

        return grad

    def temp_bytes(fn):
        compiled = jax.jit(fn, donate_argnums=2).lower(w, big, acc).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    np.testing.assert_allclose(folded(True)(w, big, acc), plain(w, big, acc), rtol=1e-5, atol=1e-5)
    stacked = (steps - 1) * big.nbytes
    assert temp_bytes(folded(False)) >= temp_bytes(plain) + stacked  # the residual path
    assert temp_bytes(folded(True)) <= temp_bytes(plain)
