"""Every backend-specific kernel against its portable reference, values and gradients, and the
`Layout` that picks them: resolved from the platform in one place, validated by name.

Each kernel table (`PROJECTIONS`, `ATTENTIONS`, `SUMS_OF_SQUARES`) is tested over all its
names, so a kernel added to a table is tested with the others. Tolerances: float32, rtol 1e-5.
"""

import ast
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.models import kernels
from jaxgrpo.models.kernels import ATTENTIONS, PROJECTIONS, SUMS_OF_SQUARES
from jaxgrpo.models.layers import attend
from jaxgrpo.models.layout import Layout


@pytest.mark.parametrize("kernel", sorted(PROJECTIONS))
@pytest.mark.parametrize(
    "x_shape, kernel_shape, n_in",
    [((2, 5, 12), (12, 3, 4), 1), ((2, 5, 3, 4), (3, 4, 12), 2), ((7, 12), (12, 2, 9), 1)],
)
def test_projection_kernels_and_their_gradients_equal_tensordot(
    kernel, x_shape, kernel_shape, n_in
):
    """Each projection kernel (XLA:CPU's forms the kernel gradient as x^T dy) equals autodiff
    of `tensordot`: value and both gradients, for q-like [D] -> [N, H], o-like [N, H] -> [D]
    and gate_up-like [D] -> [2, F] kernels."""
    kx, kw, ky = jax.random.split(jax.random.key(5), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, kernel_shape)
    dy = jax.random.normal(ky, x_shape[: len(x_shape) - n_in] + kernel_shape[n_in:])

    def plain(x, w):
        return jnp.sum(jnp.tensordot(x, w, axes=n_in) * dy)

    def ours(x, w):
        return jnp.sum(PROJECTIONS[kernel](x, w, n_in) * dy)

    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-5)
    want = jax.grad(plain, argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, w)
    for name, g, ref in zip(("dx", "dkernel"), got, want, strict=True):
        assert g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("kernel", sorted(ATTENTIONS))
@pytest.mark.parametrize(
    "heads_first, with_prompt",
    [(True, False), (True, True), (False, False)],  # a prompt part comes with heads first only
    ids=["heads first", "heads first with prompt", "keys first"],
)
def test_attention_kernels_equal_autodiff_of_the_reference(kernel, heads_first, with_prompt):
    """Each attention kernel (XLA:CPU's has a hand-written backward in the heads-first layout)
    gives the reference's output and autodiff's gradients for queries, keys, values and the
    prompt's keys and values within 1e-5 (float32), with masked keys, a masked prompt slot and
    a query row that sees no key at all."""
    b, g, t, s, kh, m, h, p = 2, 3, 5, 7, 2, 3, 8, 4
    keys = jax.random.split(jax.random.key(11), 7)
    q = jax.random.normal(keys[0], (b * g, t, kh * m, h))
    kv_shape = ((b * g, kh, h, s), (b * g, kh, s, h)) if heads_first else ((b * g, s, kh, h),) * 2
    k = jax.random.normal(keys[1], kv_shape[0])
    v = jax.random.normal(keys[2], kv_shape[1])
    mask = jax.random.bernoulli(keys[3], 0.6, (b * g, t, s)).at[1, 2].set(False)
    dout = jax.random.normal(keys[4], q.shape)
    prompt = None
    if with_prompt:
        prompt_mask = jnp.ones((b, p), bool).at[0, 0].set(False)
        prompt = (
            jax.random.normal(keys[5], (b, kh, h, p)),
            jax.random.normal(keys[6], (b, kh, p, h)),
            prompt_mask,
        )

    def loss(name, q, k, v, prompt_kv):
        full = None if prompt_kv is None else (*prompt_kv, prompt[2])
        out = attend(q, k, v, mask, heads_first=heads_first, prompt=full, kernel=name)
        return jnp.sum(out * dout)

    args = (q, k, v, None if prompt is None else prompt[:2])
    np.testing.assert_allclose(loss(kernel, *args), loss("jax", *args), rtol=1e-5)
    want = jax.grad(functools.partial(loss, "jax"), argnums=(0, 1, 2, 3))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2, 3)))(*args)
    for ref, ours in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert bool(jnp.all(jnp.isfinite(ours)))
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


SHAPES = [(), (7,), (97, 1031), (30, 576, 2, 48), (49152, 8), (3, 5, 7, 11, 13), (101, 700)]


@pytest.mark.parametrize("kernel", sorted(SUMS_OF_SQUARES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sums_of_squares_equal_float64(kernel, shape):
    """Each sum-of-squares kernel (XLA:CPU's adds slices elementwise before reducing) equals
    a float64 sum of squares on every shape, within rtol 1e-5 (the error `jnp.sum` itself
    makes at these sizes)."""
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    expected = float(np.sum(x.astype(np.float64) ** 2))
    got = float(jax.jit(SUMS_OF_SQUARES[kernel])(jnp.asarray(x)))
    assert got == pytest.approx(expected, rel=1e-5)


def test_each_table_has_the_portable_reference():
    """`Layout()`'s kernels: JAX's autodiff of the plain math, in every table."""
    for table in (PROJECTIONS, ATTENTIONS, SUMS_OF_SQUARES):
        assert "jax" in table
    assert (Layout().projection, Layout().attention, Layout().grad_norm) == ("jax",) * 3


def test_layout_for_each_platform():
    """XLA:CPU gets its kernels, unrolled decode, LM-head blocks of 256 rows, 4096-column
    micro-batches and heap trims; TPU and GPU the portable layout. "auto" unrolls the layers
    for full fine-tuning on CPU without remat only; an explicit loop is kept everywhere."""
    cpu = Layout.for_platform("cpu")
    assert (cpu.projection, cpu.attention, cpu.grad_norm) == ("xla_cpu",) * 3
    assert (cpu.layer_loop, cpu.decode_loop) == ("unroll", "unroll")
    assert (cpu.head_chunk_rows, cpu.micro_batch_columns, cpu.release_memory) == (256, 4096, True)
    for platform in ("tpu", "gpu"):
        assert Layout.for_platform(platform) == Layout()
        assert Layout.for_platform(platform, layer_loop="unroll") == Layout(layer_loop="unroll")
    assert Layout.for_platform("cpu", lora_rank=16).layer_loop == "scan"
    assert Layout.for_platform("cpu", remat=True).layer_loop == "scan"
    assert Layout.for_platform("cpu", layer_loop="scan").layer_loop == "scan"


@pytest.mark.parametrize(
    "field, value", [("projection", "pallas"), ("attention", "cpu"), ("decode_loop", "while")]
)
def test_an_unknown_layout_name_is_one_clear_error(field, value):
    with pytest.raises(ValueError, match=f"Layout.{field}='{value}'"):
        Layout(**{field: value})


PACKAGE = pathlib.Path(kernels.__file__).parents[1]
# The builders, which resolve a run's layout from its devices (and read facts about them).
BUILDERS = {
    "models/layout.py",
    "core/host.py",
    "planning/aot.py",
    "run/report.py",  # the run's header names the platform it runs on
}


def test_nothing_below_the_builders_asks_which_backend_it_runs_on():
    """No module outside the builders reads `jax.default_backend()` or a device's `.platform`,
    or compares anything to "cpu", "tpu" or "gpu": they read the run's `Layout`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("default_backend", "platform"):
                found.append(f"{rel}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Compare):
                names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if {"cpu", "tpu", "gpu"} & set(names):
                    found.append(f"{rel}:{node.lineno} compares with a backend name")
    assert found == []
