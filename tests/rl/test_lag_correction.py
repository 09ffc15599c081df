"""The loss's lag correction for stale batches (``rl.max_staleness >= 1``).

Three layers: the pure correction (``objective.lag_correction`` feeding ``policy_loss``)
against the torch reference in every loss preset; the update's loss (``make_loss_fn``) on the
tiny model, through ``ObjectiveSpec.from_config``; and where ``StepPrograms`` takes the
behaviour log-probs from. Tolerances: against torch, float64 ``rtol=1e-10`` and float32
``rtol=1e-5``, relative to the largest magnitude of the compared quantity (as
tests/rl/test_losses.py); the tiny model's gradients 1e-5 relative (float32, two compiled
programs reducing the same sums).
"""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.models.config import LoRAConfig
from jaxgrpo.models.logprobs import make_logprobs_fn
from jaxgrpo.models.tiny import tiny_model
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl import step_metrics
from jaxgrpo.rl.loss_spec import LAG_CORRECTIONS, LOSS_PRESETS, Objective
from jaxgrpo.rl.losses import masked_is_weights, policy_loss
from jaxgrpo.rl.objective import ObjectiveSpec, lag_correction, make_loss_fn
from jaxgrpo.rl.programs import StepPrograms
from jaxgrpo.settings.loading import load_config
from tests.torch_ref.batches import random_batch

torch = pytest.importorskip("torch")
from tests.torch_ref import losses as ref  # noqa: E402

RTOL = {"float64": 1e-10, "float32": 1e-5}
TORCH_DTYPE = {"float64": torch.float64, "float32": torch.float32}
BAND = dict(cap=2.0, floor=0.5)
CLIP = dict(eps_low=0.2, eps_high=0.28)  # asymmetric: "clip"'s fraction must use both
LAG_KEYS = ("lag/is_weight_mean", "lag/is_weight_max", "lag/is_clipped_frac", "lag/ess")
# r = exp(proximal - sampler) on the full row 0: truncated and masked (3.0), masked only
# (0.3), inside every band (1.1), outside the clip only (1.5); the rest of the batch random.
ROW0_RATIOS = (3.0, 0.3, 1.1, 1.5)


def _sampler_logp(proximal, mask, seed):
    """Sampler log-probs whose ratios to ``proximal`` fall inside and outside every band."""
    rng = np.random.default_rng(seed)
    log_r = rng.normal(0.0, 0.8, proximal.shape)
    log_r[0, : len(ROW0_RATIOS)] = np.log(ROW0_RATIOS)
    return np.where(mask, proximal - log_r, rng.normal(0.0, 4.0, proximal.shape))


def _close(actual, desired, rtol, what):
    desired = np.asarray(desired, np.float64)
    scale = max(float(np.max(np.abs(desired))), 1e-3)
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), desired, rtol=rtol, atol=rtol * scale, err_msg=what
    )


def _jax_side(b, sampler, mode, on_policy, loss_type, dtype):
    """Loss, metrics and d loss / d logp as `make_loss_fn` composes them."""
    objective = Objective.preset(loss_type, beta=0.04, entropy_coef=0.01, **CLIP)
    mask = jnp.asarray(b.mask)
    as_jax = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    old = None if on_policy else as_jax(b.old_logp)

    def loss(logp):
        proximal = jax.lax.stop_gradient(logp) if old is None else old
        against, weights, lag_m = lag_correction(
            mode, proximal, as_jax(sampler), mask, **BAND, **CLIP
        )
        value, m = policy_loss(
            logp, old if against is None else against, as_jax(b.ref_logp),
            as_jax(b.advantages), mask, objective, entropy=as_jax(b.entropy), is_weights=weights,
        )  # fmt: skip
        return value, {**m, **lag_m}

    return jax.value_and_grad(loss, has_aux=True)(as_jax(b.logp))


def _torch_side(b, sampler, mode, on_policy, loss_type, dtype):
    as_t = lambda x: torch.tensor(x, dtype=TORCH_DTYPE[dtype])  # noqa: E731
    logp = as_t(b.logp).requires_grad_(True)
    mask = torch.tensor(b.mask)
    old = None if on_policy else as_t(b.old_logp)
    proximal = logp.detach() if old is None else old
    against, weights, lag_m = ref.lag_correction(
        proximal, as_t(sampler), mask, mode, **BAND, **CLIP
    )
    loss, parts = ref.policy_loss(
        logp, old if against is None else against, as_t(b.ref_logp), as_t(b.advantages), mask,
        loss_type=loss_type, beta=0.04, entropy=as_t(b.entropy), entropy_coef=0.01,
        is_weights=weights, **CLIP,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), {**parts, **lag_m}, logp.grad


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("loss_type", list(LOSS_PRESETS))
def test_lag_corrections_match_torch_in_every_preset(loss_type, dtype):
    """Each correction, on-policy (proximal = stop_gradient(logp)) and with old log-probs
    given, beside a KL and an entropy term the weights must not touch: loss, gradient, the
    loss's metrics and the four lag metrics."""
    b = random_batch(seed=31 + list(LOSS_PRESETS).index(loss_type))
    with jax.enable_x64(dtype == "float64"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in LAG_CORRECTIONS:
            for on_policy in (True, False):
                what = f"{loss_type}/{mode}/{'on' if on_policy else 'off'}-policy/{dtype}"
                proximal = b.logp if on_policy else b.old_logp
                sampler = _sampler_logp(proximal, b.mask, seed=len(what))
                (loss, metrics), grad = _jax_side(b, sampler, mode, on_policy, loss_type, dtype)
                want_loss, want, want_grad = _torch_side(
                    b, sampler, mode, on_policy, loss_type, dtype
                )
                assert 0 < float(want["lag/is_clipped_frac"]) < 1, f"{what}: one-sided batch"
                rtol = RTOL[dtype]
                _close(loss, want_loss, rtol, f"{what}: loss")
                _close(grad, want_grad, rtol, f"{what}: grad wrt logp")
                for key, value in want.items():
                    _close(metrics[key], value.detach(), rtol, f"{what}: metric {key}")
                assert np.all(np.asarray(grad)[~b.mask] == 0), f"{what}: grad leaks into padding"


def test_masked_weights_keep_the_band_and_drop_the_rest():
    """r = exp(old - sampler): 3 and 0.3 leave [0.5, 2] and weigh 0; 1.1 and the edges stay."""
    ratios = np.array([[3.0, 0.3, 1.1, 0.5, 2.0]])
    w = masked_is_weights(jnp.log(ratios), jnp.zeros_like(ratios), 0.5, 2.0)
    np.testing.assert_allclose(w, [[0.0, 0.0, 1.1, 0.5, 2.0]], rtol=1e-6)


def test_no_weight_left_or_no_token_gives_finite_metrics():
    """Every token outside the band: weights 0 and an effective sample size of 0 (not 0/0);
    no valid token at all: every metric 0."""
    proximal = jnp.zeros((2, 3))
    sampler = proximal - jnp.log(5.0)  # r = 5 > cap
    mask = jnp.ones((2, 3), jnp.int32)
    _, weights, m = lag_correction("mask", proximal, sampler, mask, **BAND, **CLIP)
    assert float(jnp.max(weights)) == 0.0
    assert {k: float(v) for k, v in m.items()} == {
        "lag/is_weight_mean": 0.0,
        "lag/is_weight_max": 0.0,
        "lag/is_clipped_frac": 1.0,
        "lag/ess": 0.0,
    }
    for mode in LAG_CORRECTIONS:
        _, _, m = lag_correction(mode, proximal, sampler, 0 * mask, **BAND, **CLIP)
        assert all(float(v) == 0.0 for v in m.values()), (mode, m)


def test_update_reductions_take_the_max_of_the_max_and_the_mean_of_the_rest():
    history = [
        {"sampler_logp_gap": 0.1, "lag/is_weight_max": 1.5, "lag/ess": 0.9,
         "lag/is_weight_mean": 1.0, "lag/is_clipped_frac": 0.0},
        {"sampler_logp_gap": 0.2, "lag/is_weight_max": 2.0, "lag/ess": 0.5,
         "lag/is_weight_mean": 0.8, "lag/is_clipped_frac": 0.5},
    ]  # fmt: skip
    out = step_metrics.reduce_updates([jax.tree.map(jnp.asarray, h) for h in history])
    assert out["lag/is_weight_max"] == 2.0
    assert out["lag/ess"] == pytest.approx(0.7)
    assert out["lag/is_weight_mean"] == pytest.approx(0.9)
    assert out["lag/is_clipped_frac"] == pytest.approx(0.25)


# ----------------------------------------------------------------------------------------------
# The update's loss on the tiny model.


@pytest.fixture(scope="module")
def tiny():
    """The tiny LoRA model (adapters nudged off B = 0), a hand-built batch of 2 prompts x 4
    completions with positive advantages, and the completions' log-probs under the model."""
    cfg = load_config("tiny.py", {"run_dir": "/tmp/unused"})
    model, _ = tiny_model(LoRAConfig(rank=4, alpha=8.0), seed=0)
    graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nudged = zip(leaves, keys, strict=True)
    params = treedef.unflatten(
        [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in nudged]
    )
    g, t = cfg.rl.group_size, 6
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((2, 5), np.int32)
    prompt_mask[1, 0] = 0  # left padding
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, 2 * g)[:, None]).astype(np.int32)
    loss_mask = mask.copy()
    loss_mask[3, 0] = 0  # an id the loss does not train (a tool's)
    rows = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    batch = ro.RolloutBatch(
        prompt_ids=jnp.asarray(rng.integers(3, 300, (2, 5)), jnp.int32) * prompt_mask,
        prompt_mask=jnp.asarray(prompt_mask),
        tokens=jnp.asarray(rng.integers(3, 300, (2 * g, t)), jnp.int32) * mask,
        mask=jnp.asarray(mask),
        loss_mask=jnp.asarray(loss_mask),
        temps=jnp.ones((2 * g, t), jnp.float32),
        sampler_logp=jnp.zeros((2 * g, t), jnp.float32),
        old_logp=jnp.zeros((2 * g, t), jnp.float32),
        ref_logp=jnp.zeros((2 * g, t), jnp.float32),
        advantages=rows(np.linspace(0.5, 1.5, 2 * g)),
        shared_ids=jnp.zeros((1, 0), jnp.int32),
    )
    logprobs = make_logprobs_fn(graphdef, group_size=g)
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask, batch.temps)
    logp = logprobs(params, frozen, *inputs)[0]
    return types.SimpleNamespace(
        cfg=cfg, graphdef=graphdef, params=params, frozen=frozen, batch=batch, logp=logp
    )


def _spec(tiny, staleness, mode, use_old_logp=False):
    rl = dataclasses.replace(
        tiny.cfg.rl, beta=0.0, max_staleness=staleness, lag_correction=mode, **CLIP
    )
    return ObjectiveSpec.from_config(rl, tiny.cfg.sampling, use_old_logp=use_old_logp)


_COMPILED = {}


def _loss_and_grad(tiny, spec, **fields):
    """(loss, metrics, gradient leaves) of the update's loss on the batch with `fields`."""
    if spec not in _COMPILED:
        loss_fn = make_loss_fn(tiny.graphdef, spec)
        idx = jnp.arange(2, dtype=jnp.int32)

        def f(params, batch):
            return loss_fn(params, tiny.frozen, batch, idx, idx[None])

        _COMPILED[spec] = jax.jit(jax.value_and_grad(f, has_aux=True))
    batch = dataclasses.replace(tiny.batch, **fields)
    (loss, metrics), grad = _COMPILED[spec](tiny.params, batch)
    return float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.leaves(grad)


def _grads_close(got, want, what):
    for x, y in zip(got, want, strict=True):
        scale = float(np.abs(y).max())
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def _stale(tiny, rows, shift):
    """Sampler log-probs equal to the model's, less `shift` on `rows` (r = exp(shift))."""
    out = np.asarray(tiny.logp).copy()
    out[rows] -= shift
    return jnp.asarray(out)


def test_a_synchronous_run_has_no_lag_correction(tiny):
    """max_staleness 0: "none" whatever rl.lag_correction says; no lag metric, and the
    sampler's log-probs weigh nothing (only the gap metric reads them)."""
    for mode in LAG_CORRECTIONS:
        assert _spec(tiny, 0, mode).lag_correction == "none"
        assert _spec(tiny, 1, mode).lag_correction == mode
    spec = _spec(tiny, 0, "mask")
    _, m_near, g_near = _loss_and_grad(tiny, spec, sampler_logp=tiny.logp)
    _, m_far, g_far = _loss_and_grad(tiny, spec, sampler_logp=_stale(tiny, slice(None), 5.0))
    assert not [k for k in m_near if k.startswith("lag/")]
    assert m_far["sampler_logp_gap"] == pytest.approx(5.0, rel=1e-5)
    for x, y in zip(g_near, g_far, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_fresh_batch_changes_nothing_in_any_mode(tiny):
    """Sampler = learner (r = 1): every correction gives the synchronous loss and gradient,
    weights of 1, nothing clipped and a full effective sample size."""
    loss0, _, g0 = _loss_and_grad(tiny, _spec(tiny, 0, "tis"), sampler_logp=tiny.logp)
    for mode in LAG_CORRECTIONS:
        loss, m, g = _loss_and_grad(tiny, _spec(tiny, 1, mode), sampler_logp=tiny.logp)
        assert loss == pytest.approx(loss0, rel=1e-5), mode
        _grads_close(g, g0, mode)
        assert m["lag/is_weight_mean"] == pytest.approx(1.0, abs=1e-5), mode
        assert m["lag/is_clipped_frac"] == 0.0 and m["lag/ess"] == pytest.approx(1.0), mode


def test_each_correction_treats_a_stale_batch_as_it_should(tiny):
    """Every row's sampler 5 nats below the learner (r = e^5, advantages > 0): "tis" doubles
    the gradient (weights at the cap 2); "mask" drops every token (zero gradient); "clip"
    takes the ratio against the sampler, which its upper clip holds at 1 + eps_high (zero
    gradient)."""
    _, _, g0 = _loss_and_grad(tiny, _spec(tiny, 0, "tis"), sampler_logp=tiny.logp)
    far = _stale(tiny, slice(None), 5.0)
    _, m, g = _loss_and_grad(tiny, _spec(tiny, 1, "tis"), sampler_logp=far)
    _grads_close(g, [2 * x for x in g0], "tis")
    assert m["lag/is_weight_mean"] == pytest.approx(2.0) and m["lag/is_weight_max"] == 2.0
    assert m["lag/is_clipped_frac"] == 1.0 and m["lag/ess"] == pytest.approx(1.0)
    for mode in ("mask", "clip"):
        _, m, g = _loss_and_grad(tiny, _spec(tiny, 1, mode), sampler_logp=far)
        assert all(not np.any(x) for x in g), f"{mode}: a stale token kept its gradient"
        assert m["lag/is_clipped_frac"] == 1.0, mode
    assert m["lag/is_weight_max"] == pytest.approx(np.exp(5.0), rel=1e-4), "clip reports r"


def test_stale_rows_lose_their_gradient_and_fresh_ones_keep_it(tiny):
    """Group 0's rows stale (r = e^5), group 1's fresh: "mask" and "clip" give the gradient of
    the synchronous loss with group 0's advantages set to 0, whose tokens then add nothing."""
    adv = np.asarray(tiny.batch.advantages).copy()
    adv[:4] = 0.0
    _, _, want = _loss_and_grad(
        tiny, _spec(tiny, 0, "tis"), sampler_logp=tiny.logp, advantages=jnp.asarray(adv)
    )
    for mode in ("mask", "clip"):
        _, m, g = _loss_and_grad(
            tiny, _spec(tiny, 1, mode), sampler_logp=_stale(tiny, slice(0, 4), 5.0)
        )
        _grads_close(g, want, mode)
        assert 0 < m["lag/is_clipped_frac"] < 1, mode


def test_the_proximal_policy_is_the_batchs_old_logp_when_given(tiny):
    """With old log-probs (several updates per step), r is taken from them, not from this
    pass: old = sampler gives r = 1 although the learner is 5 nats away."""
    spec = _spec(tiny, 1, "tis", use_old_logp=True)
    far = _stale(tiny, slice(None), 5.0)
    _, m, _ = _loss_and_grad(tiny, spec, sampler_logp=far, old_logp=far)
    assert m["lag/is_weight_mean"] == pytest.approx(1.0) and m["lag/is_clipped_frac"] == 0.0
    _, m, _ = _loss_and_grad(tiny, spec, sampler_logp=far, old_logp=tiny.logp)
    assert m["lag/is_weight_mean"] == pytest.approx(2.0) and m["lag/is_clipped_frac"] == 1.0


# ----------------------------------------------------------------------------------------------
# Where the behaviour log-probs come from.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("mode", LAG_CORRECTIONS)
def test_old_logp_source(mode, epochs, staleness, dtype):
    """On-policy: none. Synchronous: the sampler's in float32, else a forward (unchanged).
    Stale: "tis" and "mask" need the learner's forward (the sampler's are the old policy's);
    "clip" reads the sampler's itself."""
    over = {"rl.ppo_epochs": epochs, "rl.max_staleness": staleness, "rl.lag_correction": mode}
    cfg = load_config("tiny.py", {"run_dir": "/tmp/unused", **over})
    programs = types.SimpleNamespace(
        rl=cfg.rl, updates_per_step=epochs, model_cfg=types.SimpleNamespace(dtype=dtype)
    )
    if epochs == 1:
        want = "none"
    elif staleness == 0:
        want = "sampler" if dtype == "float32" else "forward"
    else:
        want = "none" if mode == "clip" else "forward"
    assert StepPrograms._old_logp_source(programs) == want


@pytest.mark.parametrize("mode", LAG_CORRECTIONS)
def test_programs_build_the_stale_objective(mode):
    """A StepPrograms of a stale run with two updates per step: the objective corrects with
    `mode` and reads the batch's old log-probs exactly when they come from a forward."""
    over = {"rl.ppo_epochs": 2, "rl.max_staleness": 1, "rl.lag_correction": mode}
    cfg = load_config("tiny.py", {"run_dir": "/tmp/unused", **over})
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    model, _ = tiny_model(LoRAConfig(rank=4, alpha=8.0), seed=0, mesh=mesh)
    programs = StepPrograms(cfg, model, mesh)
    assert programs.objective.lag_correction == mode
    assert programs.objective.use_old_logp == (programs.old_from == "forward")
    assert programs.old_from == ("none" if mode == "clip" else "forward")
