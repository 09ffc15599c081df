"""The global normaliser: micro-batch accumulation and 8-device sharding give the full gradient.

A tiny linear policy (``logits = x @ W``) makes the gradient a sum over sequences of a shared
parameter's gradients, as in training. Every loss type runs with KL (k3), dual clip, an entropy
bonus from temperature-scaled logits and the top-entropy restriction all on, so each of those
normalisers is exercised. Tolerance: float32, ``rtol=1e-5`` relative to ``max|full gradient|``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgrpo.rl.loss_spec import Objective
from jaxgrpo.rl.losses import (
    loss_normalizers,
    policy_loss,
    token_entropy,
    top_entropy_threshold,
)

# The four aggregation presets (gspo shares grpo's aggregation; its sequence ratio is local).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gr_reinforce")
R, T, F, V = 16, 9, 4, 7
OPTIONS = dict(beta=0.04, dual_clip=3.0, entropy_coef=0.01)
TEMPERATURE = 0.9
TOP_FRAC = 0.5


@pytest.fixture(scope="module")
def problem():
    """Policy weights ``W [F, V]`` and a ragged rollout batch of R sequences."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, T + 1, R)
    lengths[3] = 0
    batch = {
        "x": rng.normal(size=(R, T, F)).astype(np.float32),
        "tokens": rng.integers(0, V, (R, T)).astype(np.int32),
        "mask": np.arange(T)[None, :] < lengths[:, None],
        "adv": rng.normal(size=R).astype(np.float32),
    }
    w = rng.normal(size=(F, V)).astype(np.float32)
    logp = np.asarray(_logp_logits(w, batch)[0])
    batch["old_logp"] = (logp + rng.normal(0.0, 0.5, (R, T))).astype(np.float32)
    batch["ref_logp"] = (logp + rng.normal(0.0, 0.5, (R, T))).astype(np.float32)
    return w, batch


def _logp_logits(w_FV, batch):
    logits_RTV = jnp.einsum("RTF,FV->RTV", batch["x"], w_FV)
    logp_RTV = jax.nn.log_softmax(logits_RTV, axis=-1)
    logp_RT = jnp.take_along_axis(logp_RTV, batch["tokens"][..., None], axis=-1)[..., 0]
    return logp_RT, logits_RTV


def _loss(w_FV, batch, norm, loss_type):
    """Loss of (a slice of) the batch; ``norm=None`` uses this batch's own normalisers (and
    its own entropy threshold, from ``top_entropy_frac``)."""
    logp_RT, logits_RTV = _logp_logits(w_FV, batch)
    objective = Objective.preset(loss_type, top_entropy_frac=TOP_FRAC, **OPTIONS)
    return policy_loss(
        logp_RT,
        batch["old_logp"],
        batch["ref_logp"],
        batch["adv"],
        batch["mask"],
        objective,
        logits=logits_RTV,
        temperature=TEMPERATURE,
        **(norm or {}),
    )[0]


def _global_norm(w_FV, batch):
    """Whole-step normalisers and entropy threshold, as a trainer computes them once per step."""
    entropy_RT = token_entropy(_logp_logits(w_FV, batch)[1], TEMPERATURE)
    return {
        **loss_normalizers(batch["mask"]),
        "entropy_threshold": top_entropy_threshold(entropy_RT, batch["mask"], TOP_FRAC),
    }


def _split(tree, k):
    return jax.tree.map(lambda a: a.reshape(k, R // k, *a.shape[1:]), tree)


def _accumulated(grad_fn, w_FV, batch, k, norm=None):
    """Sum of the gradients of k equal micro-batches (vmapped: one traced copy of the loss).

    With ``norm`` every micro-batch uses those whole-step normalisers; without, each uses its
    own (the mistake the global normaliser exists to avoid).
    """
    micro = _split(batch, k)
    if norm is None:
        norm, axis = jax.vmap(_global_norm, in_axes=(None, 0))(w_FV, micro), 0
    else:
        axis = None
    grads_kFV = jax.vmap(grad_fn, in_axes=(None, 0, axis))(w_FV, micro, norm)
    return jnp.sum(grads_kFV, axis=0)


def _close(actual, desired, what):
    scale = float(np.max(np.abs(desired)))
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def _every_loss_type(w_FV, batch, norm):
    return {lt: jax.grad(_loss)(w_FV, batch, norm, lt) for lt in LOSS_TYPES}


@pytest.fixture(scope="module")
def full_grads(problem):
    """Reference: each loss type's gradient of the whole batch on one device, own normalisers."""
    w, batch = problem
    grads = jax.jit(functools.partial(_every_loss_type, norm=None))(w, batch)
    assert all(np.abs(g).max() > 0 for g in grads.values())
    return grads


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_microbatch_accumulation_equals_full_batch(problem, full_grads, loss_type):
    w, batch = problem

    @jax.jit
    def accumulated(w, batch):
        grad = jax.grad(functools.partial(_loss, loss_type=loss_type))
        norm = _global_norm(w, batch)
        acc = {k: _accumulated(grad, w, batch, k, norm) for k in (1, 2, 4)}
        return acc, _accumulated(grad, w, batch, 4)

    acc, naive = accumulated(w, batch)
    full = full_grads[loss_type]
    for k, g in acc.items():
        _close(g, full, f"{loss_type}: {k} micro-batches")
    # Each micro-batch normalised by itself is wrong: the test can tell the difference.
    assert not np.allclose(naive, full, rtol=1e-3), loss_type


def test_eight_devices_equal_one(problem, full_grads):
    w, batch = problem
    assert jax.device_count() == 8, "tests/conftest.py sets 8 virtual CPU devices"
    # Auto axis types (GSPMD), as jaxgrpo.core.sharding builds its meshes.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    batch_sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    w_rep = jax.device_put(w, NamedSharding(mesh, P()))
    gspmd = jax.jit(functools.partial(_every_loss_type, norm=None))(w_rep, batch_sharded)

    # Each device: its 2 rows with the whole step's normalisers. shard_map's autodiff already
    # all-reduces the gradient of the replicated `w` (the transpose of its implicit broadcast
    # to the devices is a psum), so the result is the sum of the per-device gradients.
    per_device = _every_loss_type

    norm = _global_norm(w, batch)
    explicit = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P())
    )(w_rep, batch_sharded, norm)
    for lt in LOSS_TYPES:
        _close(gspmd[lt], full_grads[lt], f"{lt}: jit over an 8-device mesh")
        _close(explicit[lt], full_grads[lt], f"{lt}: shard_map + psum with global normalisers")
