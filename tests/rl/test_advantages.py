"""Group advantages: torch reference, the std convention, zero-variance groups, RLOO."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.rl import advantages as adv_mod

torch = pytest.importorskip("torch")
from tests.torch_ref import losses as ref  # noqa: E402


def group_advantages(rewards, group_size, scale="group", eps=1e-4, **kw):
    """The function under test, jitted: one compile is far cheaper than eager op-by-op here."""
    fn = functools.partial(adv_mod.group_advantages, group_size=group_size, scale=scale, **kw)
    return jax.jit(fn)(rewards, eps=eps)


def rloo_advantages(rewards, group_size):
    return jax.jit(adv_mod.rloo_advantages, static_argnums=1)(rewards, group_size)


def _rewards(seed, n_groups, group_size):
    """Random rewards with one all-equal group and one group holding ties."""
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(n_groups, group_size)).round(1)
    r[0] = 0.7
    if n_groups > 2 and group_size > 2:
        r[1, :2] = r[1, 2]
    return r.reshape(-1)


def test_matches_torch_reference_float64():
    with jax.enable_x64(True):
        for g, scale, baseline in itertools.product(
            (1, 2, 4), ("group", "batch", "none"), ("mean", "rloo")
        ):
            rewards = _rewards(g, 5, g)
            got = group_advantages(jnp.asarray(rewards), g, scale, baseline=baseline)
            want = ref.group_advantages(torch.tensor(rewards), g, scale, baseline=baseline)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12, err_msg=str(g))


def test_std_is_bessel_corrected():
    """Group [0, 1]: Bessel std = sqrt(1/2), so A = +-0.5 / (sqrt(0.5) + 1e-4) ~ +-0.7070;
    the population std 0.5 would give +-0.9998 instead."""
    adv = group_advantages(jnp.array([0.0, 1.0]), 2, "group")
    np.testing.assert_allclose(adv, [-0.5, 0.5] / (np.sqrt(0.5) + 1e-4), rtol=1e-6)
    batch = group_advantages(jnp.array([0.0, 1.0, 2.0, 4.0]), 2, "batch", eps=0.0)
    np.testing.assert_allclose(batch, [-0.5, 0.5, -1, 1] / np.std([0, 1, 2, 4], ddof=1), rtol=1e-6)


def test_zero_variance_groups_are_zero_and_counted():
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 0.1, 0.1, 0.1, 5.0, 5.0, 5.0])
    for scale in ("group", "batch", "none"):
        adv, metrics = group_advantages(rewards, 3, scale, eps=0.0, return_metrics=True)
        assert np.all(np.isfinite(adv)), scale
        np.testing.assert_array_equal(np.asarray(adv)[[0, 1, 2, 6, 7, 8, 9, 10, 11]], 0.0)
        assert float(metrics["frac_zero_std_groups"]) == 0.75, scale
    constant = jnp.full((8,), 3.0)
    adv, metrics = group_advantages(constant, 4, "batch", eps=0.0, return_metrics=True)
    assert np.all(adv == 0) and float(metrics["frac_zero_std_groups"]) == 1.0


def test_group_size_one_gives_zero_not_nan():
    adv, metrics = group_advantages(jnp.arange(4.0), 1, "group", return_metrics=True)
    np.testing.assert_array_equal(adv, 0.0)
    assert float(metrics["frac_zero_std_groups"]) == 1.0


def test_each_group_has_zero_mean():
    rewards = jnp.asarray(_rewards(3, 6, 4))
    for scale, baseline in itertools.product(("group", "batch", "none"), ("mean", "rloo")):
        adv = group_advantages(rewards, 4, scale, baseline=baseline).reshape(6, 4)
        np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-6, err_msg=scale + baseline)


def test_rloo_is_leave_one_out_mean():
    """Group [1, 2, 6]: baselines (2+6)/2, (1+6)/2, (1+2)/2 = 4, 3.5, 1.5 -> -3, -1.5, 4.5,
    which is G/(G-1) = 3/2 times the mean-baseline advantages [-2, -1, 3]."""
    rewards = jnp.array([1.0, 2.0, 6.0])
    np.testing.assert_allclose(rloo_advantages(rewards, 3), [-3.0, -1.5, 4.5], rtol=1e-6)
    mean_adv = group_advantages(rewards, 3, "none")
    np.testing.assert_allclose(rloo_advantages(rewards, 3), 1.5 * mean_adv, rtol=1e-6)


def test_jittable_with_traced_eps():
    f = jax.jit(lambda r, eps: adv_mod.group_advantages(r, 2, "group", eps))
    r = jnp.array([0.0, 1.0, 3.0, 3.0])
    a, b = f(r, 1e-4), f(r, 1.0)
    assert f._cache_size() == 1
    np.testing.assert_allclose(b[:2], [-0.5, 0.5] / (np.sqrt(0.5) + 1.0), rtol=1e-6)
    assert not np.allclose(a, b)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale"):
        adv_mod.group_advantages(jnp.ones(4), 2, "std")
    with pytest.raises(ValueError, match="multiple of group_size"):
        adv_mod.group_advantages(jnp.ones(5), 2)
    with pytest.raises(ValueError, match="baseline"):
        adv_mod.group_advantages(jnp.ones(4), 2, baseline="median")
