"""Checkpointer: exact round trip of mixed pytrees, keep-K, shardings, refusal of non-finite."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo.rl.checkpoint import Checkpointer, NonFiniteCheckpointError


def _state(seed: int, sharding=None):
    """A TrainState-like pytree: params, optax Adam state, int step, typed RNG key, scalar."""
    rng = np.random.default_rng(seed)
    params = {
        "lora_a": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "layers": [{"b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)}],
    }
    if sharding is not None:
        params["lora_a"] = jax.device_put(params["lora_a"], sharding)
    opt_state = optax.adamw(1e-3).init(params)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.asarray(seed, jnp.int32),
        "rng": jax.random.key(seed),
        "skipped": 3,
    }


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_keep_and_latest(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=2, keep=2)
    assert ckpt.latest_step() is None
    saved = {}
    for step in range(1, 8):
        state = _state(step)
        if ckpt.save(step, state, {"cursor": step * 10, "config": {"a": [1, 2]}}):
            saved[step] = state
    assert sorted(saved) == [2, 4, 6], "every=2 saves exactly the even steps"
    assert ckpt.save(7, _state(7), {"cursor": 70}, force=True), "force saves off-period"
    assert ckpt.latest_step() == 7
    assert ckpt.all_steps() == [6, 7], "keep=2 keeps only the two newest"

    target = _state(0)
    restored, meta = ckpt.restore(target, step=6)
    _assert_tree_equal(restored, saved[6])
    assert meta == {"cursor": 60, "config": {"a": [1, 2]}}
    assert isinstance(restored["skipped"], int)
    # A fresh manager on the same directory (a resumed process) sees the same checkpoints.
    ckpt.close()
    again = Checkpointer(str(tmp_path / "ckpt"), every=2, keep=2)
    assert again.latest_step() == 7
    _, meta = again.restore(target)
    assert meta["cursor"] == 70


def test_restore_uses_target_sharding(tmp_path):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (virtual) devices")
    mesh = Mesh(devices.reshape(4, 2), ("data", "fsdp"))
    ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
    ckpt.save(1, _state(1), {})  # saved from a single-device layout
    sharding = NamedSharding(mesh, PartitionSpec("data", "fsdp"))
    target = jax.eval_shape(lambda: _state(0))
    target["params"]["lora_a"] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)
    target["rng"] = jax.random.key(0)
    target["skipped"] = 0
    restored, _ = ckpt.restore(target)
    assert restored["params"]["lora_a"].sharding == sharding
    _assert_tree_equal(restored["params"], _state(1)["params"])


def test_refuses_non_finite_and_structure_mismatch(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    bad = _state(1)
    bad["params"]["layers"][0]["b"] = bad["params"]["layers"][0]["b"].at[2].set(jnp.nan)
    with pytest.raises(NonFiniteCheckpointError, match=r"\['layers'\]\[0\]\['b'\]"):
        ckpt.save(1, bad, {})
    assert ckpt.latest_step() is None, "nothing may be written for a non-finite state"
    ckpt.save(2, _state(2), {})
    wrong = _state(0)
    wrong["params"]["extra"] = jnp.zeros(3)
    with pytest.raises(ValueError, match="different tree structure"):
        ckpt.restore(wrong)
