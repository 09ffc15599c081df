"""Policy losses against the independent torch reference, plus the PPO clip-sign pin.

Tolerances: float64 ``rtol=1e-9``, float32 ``rtol=1e-5``, both relative to the largest
magnitude of the compared quantity (``atol = rtol * max|reference|``), so values near zero are
judged on the scale of the array they belong to.
"""

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.rl import kl as kl_mod
from jaxgrpo.rl.loss_spec import LOSS_PRESETS, Objective
from jaxgrpo.rl.losses import policy_loss, top_entropy_threshold
from tests.torch_ref.batches import random_batch

torch = pytest.importorskip("torch")
from tests.torch_ref import losses as ref  # noqa: E402

RTOL = {"float64": 1e-9, "float32": 1e-5}
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gr_reinforce", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3")
CLIPS = {
    "symmetric": dict(eps_low=0.2, eps_high=0.2),
    "clip_higher": dict(eps_low=0.2, eps_high=0.28),
    "dual_clip": dict(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
    "ratio_cap": dict(eps_low=0.2, eps_high=0.2, ratio_cap=1.5),
}
TORCH_DTYPE = {"float64": torch.float64, "float32": torch.float32}
# The keyword arguments of the torch reference that `policy_loss` takes per call; the others
# are the `Objective`'s.
PER_CALL = (
    "logits",
    "temperature",
    "entropy",
    "is_weights",
    "teacher_logp",
    "num_tokens",
    "num_sequences",
)


def _policy_loss(logp, old_logp, ref_logp, advantages, mask, **kw):
    """`policy_loss` given the torch reference's flat keyword arguments."""
    per_call = {k: kw.pop(k) for k in PER_CALL if k in kw}
    objective = Objective.preset(**kw)
    return policy_loss(logp, old_logp, ref_logp, advantages, mask, objective, **per_call)


def _close(actual, desired, rtol, what):
    desired = np.asarray(desired, np.float64)
    scale = max(float(np.max(np.abs(desired))), 1e-3) if desired.size else 1.0
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), desired, rtol=rtol, atol=rtol * scale, err_msg=what
    )


def _compare(batch, dtype, what, with_logits=False, **kw):
    """Loss, metrics and d loss / d logp (and d / d logits) of jax vs torch."""
    names = ("old_logp", "ref_logp", "advantages")
    jx = {k: jnp.asarray(getattr(batch, k), dtype) for k in names}
    tt = {k: torch.tensor(getattr(batch, k), dtype=TORCH_DTYPE[dtype]) for k in names}
    for extra in ("entropy", "is_weights", "teacher_logp"):
        if kw.pop(extra, False):
            jx[extra] = jnp.asarray(getattr(batch, extra), dtype)
            tt[extra] = torch.tensor(getattr(batch, extra), dtype=TORCH_DTYPE[dtype])

    def jax_loss(logp, logits):
        extra = {"logits": logits} if with_logits else {}
        return _policy_loss(logp, mask=jnp.asarray(batch.mask), **jx, **extra, **kw)

    grad_fn = jax.value_and_grad(jax_loss, argnums=(0, 1), has_aux=True)
    (loss, metrics), (g_logp, g_logits) = grad_fn(
        jnp.asarray(batch.logp, dtype), jnp.asarray(batch.logits, dtype)
    )
    logp_t = torch.tensor(batch.logp, dtype=TORCH_DTYPE[dtype], requires_grad=True)
    logits_t = torch.tensor(batch.logits, dtype=TORCH_DTYPE[dtype], requires_grad=True)
    extra_t = {"logits": logits_t} if with_logits else {}
    loss_t, parts = ref.policy_loss(logp_t, mask=torch.tensor(batch.mask), **tt, **extra_t, **kw)
    loss_t.backward()
    rtol = RTOL[dtype]
    assert loss.dtype == jnp.dtype(dtype), (what, loss.dtype)
    _close(loss, loss_t.detach(), rtol, f"{what}: loss")
    _close(g_logp, logp_t.grad, rtol, f"{what}: grad wrt logp")
    if with_logits:
        _close(g_logits, logits_t.grad, rtol, f"{what}: grad wrt logits")
    for key, value in parts.items():
        _close(metrics[key], value.detach(), rtol, f"{what}: metric {key}")
    assert np.all(np.asarray(g_logp)[~batch.mask] == 0), f"{what}: grad leaks into padding"


def _x64(dtype):
    return jax.enable_x64(dtype == "float64")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_torch_for_every_kl_estimator_and_clip_setting(loss_type, dtype):
    batch = random_batch(seed=LOSS_TYPES.index(loss_type))
    with _x64(dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the k1-in-loss warning is tested on its own
        for kl_estimator, clip in itertools.product(KL_ESTIMATORS, CLIPS):
            what = f"{loss_type}/{kl_estimator}/{clip}/{dtype}"
            kw = dict(CLIPS[clip], loss_type=loss_type, beta=0.04, kl_estimator=kl_estimator)
            _compare(batch, dtype, what, **kw)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_separately_chosen_parts_and_options_match_torch(dtype):
    batch = random_batch(seed=11)
    cases = {
        "reinforce+token_mean": dict(surrogate="reinforce", aggregation="token_mean"),
        "clip+constant+seq ratio": dict(aggregation="constant", ratio_level="sequence"),
        "global normalisers": dict(
            loss_type="dapo", num_tokens=97, num_sequences=13, max_completion_length=17
        ),
        "global normalisers grpo": dict(num_sequences=13),
        "global normalisers dr_grpo": dict(
            loss_type="dr_grpo", num_sequences=13, max_completion_length=17
        ),
        "no reference": dict(loss_type="dapo", ref_logp=None),
        "on-policy": dict(loss_type="grpo", old_logp=None, beta=0.1),
        "is weights": dict(loss_type="dapo", is_weights=True),
        "entropy bonus (given)": dict(entropy=True, entropy_coef=0.01),
        "top entropy fraction": dict(loss_type="dapo", entropy=True, top_entropy_frac=0.3),
    }
    with _x64(dtype):
        for what, kw in cases.items():
            b = random_batch(seed=11)
            if "ref_logp" in kw or "old_logp" in kw:
                _compare_none(b, dtype, what, **kw)
            else:
                _compare(batch, dtype, what, **kw)


def _compare_none(batch, dtype, what, **kw):
    """Like `_compare` but with an input passed as None to both implementations (and the
    teacher's log-probs given, with ``teacher_logp=True``)."""
    for key in ("ref_logp", "old_logp"):
        if key in kw:
            setattr(batch, key, None)
            kw.pop(key)
    teacher = kw.pop("teacher_logp", False)
    jx = {
        k: None if getattr(batch, k) is None else jnp.asarray(getattr(batch, k), dtype)
        for k in ("old_logp", "ref_logp", "advantages")
    }
    tt = {
        k: None if getattr(batch, k) is None else torch.tensor(getattr(batch, k))
        for k in ("old_logp", "ref_logp", "advantages")
    }
    if teacher:
        jx["teacher_logp"] = jnp.asarray(batch.teacher_logp, dtype)
        tt["teacher_logp"] = torch.tensor(batch.teacher_logp)
    tt = {k: v if v is None else v.to(TORCH_DTYPE[dtype]) for k, v in tt.items()}
    fn = lambda lp: _policy_loss(lp, mask=jnp.asarray(batch.mask), **jx, **kw)
    (loss, _), g = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(batch.logp, dtype))
    logp_t = torch.tensor(batch.logp, dtype=TORCH_DTYPE[dtype], requires_grad=True)
    loss_t, _ = ref.policy_loss(logp_t, mask=torch.tensor(batch.mask), **tt, **kw)
    loss_t.backward()
    _close(loss, loss_t.detach(), RTOL[dtype], f"{what}: loss")
    _close(g, logp_t.grad, RTOL[dtype], f"{what}: grad")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_distillation_term_matches_torch_in_every_preset(loss_type, dtype):
    """The teacher's per-token term in the advantage: loss, gradient and the reverse-KL metric
    against the torch reference, off-policy (old log-probs given) and on-policy, alone (no
    sequence advantage) and with one, beside a KL term."""
    batch = random_batch(seed=21 + LOSS_TYPES.index(loss_type))
    with _x64(dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for coef, clip in itertools.product((0.5, 2.0), ("symmetric", "dual_clip")):
            what = f"{loss_type}/distill {coef}/{clip}/{dtype}"
            kw = dict(CLIPS[clip], loss_type=loss_type, beta=0.04, distill_coef=coef)
            _compare(batch, dtype, what, teacher_logp=True, **kw)
        alone = dataclasses.replace(batch, advantages=np.zeros_like(batch.advantages))
        _compare(alone, dtype, f"{loss_type}/distillation only", teacher_logp=True,
                 loss_type=loss_type, distill_coef=1.0)  # fmt: skip
        for coef in (0.0, 1.0):
            _compare_none(
                random_batch(seed=3), dtype, f"{loss_type}/on-policy distill {coef}",
                old_logp=None, teacher_logp=True, loss_type=loss_type, distill_coef=coef,
            )  # fmt: skip


def test_distillation_gradient_is_the_teachers_log_ratio_on_policy():
    """On-policy, with no sequence advantage, the token-mean loss's gradient wrt logp is
    ``-coef * (teacher_logp - logp) / num_tokens`` on every valid token: the reverse-KL
    policy gradient, derived by hand."""
    b = random_batch(seed=4)
    objective = Objective.preset("dapo", distill_coef=0.7)
    mask = jnp.asarray(b.mask)

    def loss(logp):
        zero = jnp.zeros(b.advantages.shape)
        return policy_loss(logp, None, None, zero, mask, objective, teacher_logp=b.teacher_logp)

    (_, metrics), g = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(b.logp, jnp.float32))
    want = np.where(b.mask, -0.7 * (b.teacher_logp - b.logp) / b.mask.sum(), 0.0)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-7)
    kl = (b.logp - b.teacher_logp)[b.mask].mean()
    np.testing.assert_allclose(float(metrics["distill_reverse_kl"]), kl, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_entropy_from_temperature_scaled_logits_matches_torch(dtype):
    batch = random_batch(seed=5)
    temps = np.random.default_rng(0).uniform(0.5, 1.5, batch.mask.shape)
    with _x64(dtype):
        for what, temperature in (("scalar T", 0.7), ("per-token T", temps)):
            kw = dict(entropy_coef=0.05, temperature=temperature, top_entropy_frac=0.5)
            _compare(batch, dtype, what, with_logits=True, **kw)


def test_negative_advantage_clip_bounds_ratio_from_below():
    """PPO with A < 0: loss = |A| * max(r, clip(r)). With eps = 0.2 and A = -1:

    r = 0.5 is clipped from below: loss = 0.8, zero gradient (no gain from lowering pi more);
    r = 1.5 is not clipped: loss = 1.5 and d loss / d logp = r = 1.5. An inverted clip (bounding
    r from above for A < 0) would give loss 1.2 and zero gradient at r = 1.5 instead.
    """
    old_logp = jnp.zeros((2, 1))
    logp = jnp.log(jnp.array([[0.5], [1.5]]))
    mask = jnp.ones((2, 1), bool)
    for loss_type in ("dapo", "grpo"):

        def per_row(lp, loss_type=loss_type):
            objective = Objective.preset(loss_type)
            return policy_loss(lp, old_logp, None, -jnp.ones(2), mask, objective)

        (loss, metrics), grad = jax.jit(jax.value_and_grad(per_row, has_aux=True))(logp)
        # Both aggregations average the two single-token rows: (0.8 + 1.5) / 2.
        np.testing.assert_allclose(loss, (0.8 + 1.5) / 2, rtol=1e-6)
        np.testing.assert_allclose(grad[:, 0], [0.0, 1.5 / 2], rtol=1e-6)
        assert float(metrics["clip_frac_low"]) == 0.5 and float(metrics["clip_frac_high"]) == 0


def test_dual_clip_caps_negative_advantage_loss():
    """Dual clip c = 3, A = -1, r = 5: loss = min(max(5, 1.2), 3) = 3, with zero gradient."""
    fn = lambda lp: policy_loss(
        lp, jnp.zeros((1, 1)), None, -jnp.ones(1), jnp.ones((1, 1)), Objective(dual_clip=3.0)
    )
    (loss, _), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.log(jnp.full((1, 1), 5.0)))
    np.testing.assert_allclose(loss, 3.0, rtol=1e-6)
    assert float(grad[0, 0]) == 0.0


def test_padding_garbage_nan_inf_is_ignored():
    batch = random_batch(seed=3)
    pad = ~batch.mask
    clean = {k: np.where(pad, 0.0, getattr(batch, k)) for k in ("logp", "old_logp", "ref_logp")}
    dirty = {k: np.where(pad, np.nan, v) for k, v in clean.items()}
    dirty["old_logp"] = np.where(pad, -np.inf, clean["old_logp"])
    out = []
    for arrays in (clean, dirty):
        a = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}
        fn = lambda lp, a=a: policy_loss(
            lp, a["old_logp"], a["ref_logp"], batch.advantages, batch.mask, Objective(beta=0.1)
        )
        out.append(jax.value_and_grad(fn, has_aux=True)(a["logp"]))
    (loss_c, m_c), g_c = out[0]
    (loss_d, m_d), g_d = out[1]
    assert np.isfinite(loss_d) and np.all(np.isfinite(g_d))
    np.testing.assert_array_equal(loss_c, loss_d)
    np.testing.assert_array_equal(g_c, g_d)
    for key in m_c:
        np.testing.assert_array_equal(m_c[key], m_d[key], err_msg=key)


def test_coefficients_are_traced_and_never_recompile():
    batch = random_batch(seed=4)
    args = [jnp.asarray(getattr(batch, k), jnp.float32) for k in ("logp", "old_logp", "ref_logp")]

    dapo = Objective.preset("dapo")

    @jax.jit
    def step(logp, old, refl, coeffs, entropy):
        objective = dataclasses.replace(dapo, **coeffs)
        fn = lambda lp: policy_loss(
            lp, old, refl, batch.advantages, batch.mask, objective, entropy=entropy
        )[0]
        return jax.grad(fn)(logp)

    grads = []
    for i, scale in enumerate((1.0, 1.5, 2.0)):
        coeffs = dict(
            eps_low=0.2 * scale,
            eps_high=0.28 * scale,
            beta=0.04 * scale,
            dual_clip=3.0 * scale,
            ratio_cap=2.0 * scale,
            entropy_coef=0.01 * scale,
            top_entropy_frac=0.5 / scale,
        )
        coeffs = {k: jnp.float32(v) for k, v in coeffs.items()}
        grads.append(step(*args, coeffs, batch.entropy.astype(np.float32)))
        assert step._cache_size() == 1, f"call {i} recompiled"
    assert not np.allclose(grads[0], grads[2]), "coefficients had no effect"


def test_metrics_ignore_padding():
    batch = random_batch(seed=6)
    args = (batch.logp, batch.old_logp, batch.ref_logp, batch.advantages, batch.mask)
    loss, m = policy_loss(*args, Objective(beta=0.1))
    r = np.exp(batch.logp - batch.old_logp)[batch.mask]
    np.testing.assert_allclose(
        [m["ratio_min"], m["ratio_max"], m["ratio_mean"], m["num_tokens"]],
        [r.min(), r.max(), r.mean(), batch.mask.sum()],
        rtol=1e-5,
    )
    np.testing.assert_allclose(m["loss"], m["policy_loss"] + m["kl_loss"], rtol=1e-6)
    np.testing.assert_allclose(loss, m["loss"], rtol=0)


def test_k1_in_loss_warns_exactly_once(monkeypatch):
    monkeypatch.setattr(kl_mod, "_warned_k1", False)
    batch = random_batch(seed=7)
    args = (batch.logp, batch.old_logp, batch.ref_logp, batch.advantages, batch.mask)
    call = lambda est, beta: policy_loss(*args, Objective(kl_estimator=est, beta=beta))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call("k3", 0.1)
        call("k1", 0.0)  # KL off: nothing to warn about
        assert not caught
        call("k1", 0.1)
        call("k1", jnp.float32(0.2))
    assert len(caught) == 1 and "zero in expectation" in str(caught[0].message)


def test_kl_in_reward_matches_torch():
    batch = random_batch(seed=8)
    rewards = np.random.default_rng(1).normal(size=batch.advantages.shape)
    with jax.enable_x64(True):
        got, kl_n = kl_mod.kl_penalized_rewards(
            jnp.asarray(rewards), jnp.asarray(batch.logp), jnp.asarray(batch.ref_logp),
            jnp.asarray(batch.mask), 0.05,
        )  # fmt: skip
    want, kl_t = ref.kl_penalized_rewards(
        torch.tensor(rewards), torch.tensor(batch.logp), torch.tensor(batch.ref_logp),
        torch.tensor(batch.mask), 0.05,
    )  # fmt: skip
    _close(got, want, 1e-12, "penalized rewards")
    _close(kl_n, kl_t, 1e-12, "summed k1")


def test_top_entropy_threshold_matches_torch_quantile():
    batch = random_batch(seed=9)
    with jax.enable_x64(True):
        for frac in (0.0, 0.2, 0.37, 1.0):
            got = top_entropy_threshold(jnp.asarray(batch.entropy), jnp.asarray(batch.mask), frac)
            want = torch.quantile(torch.tensor(batch.entropy[batch.mask]), 1 - frac)
            _close(got, want, 1e-12, f"frac={frac}")
    empty = top_entropy_threshold(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), 0.2)
    assert np.isposinf(empty)


def test_unknown_names_raise_with_the_name():
    batch = random_batch(seed=0)
    args = (batch.logp, batch.old_logp, batch.ref_logp, batch.advantages, batch.mask)
    for kw, name in (
        (dict(loss_type="ppo2"), "ppo2"),
        (dict(aggregation="sum"), "sum"),
        (dict(surrogate="kl"), "kl"),
        (dict(kl_estimator="k4", beta=0.1), "k4"),
        (dict(entropy_coef=0.1), "entropy_coef"),
    ):
        with pytest.raises(ValueError, match=name):
            policy_loss(*args, Objective.preset(**kw))
    assert set(LOSS_PRESETS) >= {"grpo", "dapo", "dr_grpo", "gr_reinforce"}


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_kl_bias_correction_gradient_equals_the_hand_derived_one(ratio_level):
    """TRL's ``use_bias_correction_kl``: the per-token k3 KL times the ratio r = exp(logp - old).

    On-policy (old = stop_gradient(logp)) r = 1, so the loss value is unchanged, but grad r =
    grad logp: with d = ref - logp, k3 = e^d - d - 1 and dk3/dlogp = 1 - e^d, the token-mean
    loss beta * sum(r * k3) / n has the gradient beta * (1 - e^d + k3) / n at every valid token
    (token-level ratio); the uncorrected one is beta * (1 - e^d) / n. For the sequence-level
    ratio, d r / d logp_t = 1 / n_i on every token t of sequence i, so token t gets
    beta / n * (1 - e^d_t + sum_s k3_is / n_i).
    """
    rng = np.random.default_rng(0)
    logp = rng.normal(-1.0, 0.5, (3, 5))
    ref = logp + rng.normal(0.0, 0.3, (3, 5))
    mask = np.ones((3, 5), bool)
    mask[1, 3:] = mask[2, 4:] = False
    beta, n = 0.1, mask.sum()

    def loss(lp, correct):
        objective = Objective.preset(
            "dapo", beta=beta, kl_estimator="k3", kl_bias_correction=correct,
            ratio_level=ratio_level,
        )  # fmt: skip
        return policy_loss(lp, None, ref, jnp.zeros(3), mask, objective)[0]

    d = ref - logp
    k3 = np.exp(d) - d - 1
    if ratio_level == "token":
        correction = k3
    else:
        correction = np.broadcast_to(
            (k3 * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True), k3.shape
        )
    expected = np.where(mask, beta * (1 - np.exp(d) + correction) / n, 0.0)
    plain = np.where(mask, beta * (1 - np.exp(d)) / n, 0.0)
    with jax.enable_x64(True):
        lp = jnp.asarray(logp, jnp.float64)
        got = np.asarray(jax.grad(loss)(lp, True))
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(np.asarray(jax.grad(loss)(lp, False)), plain, rtol=1e-9)
        assert float(loss(lp, True)) == pytest.approx(float(loss(lp, False)), rel=1e-12)
