"""GRPO-family policy losses: surrogates, aggregations, presets, entropy terms and metrics.

A loss is a **surrogate** (per-token objective) followed by an **aggregation** (how per-token
values become one scalar). With ``r`` the importance ratio and ``A`` the token's sequence
advantage:

Surrogates:
  * ``"clip"`` (PPO/GRPO): ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)``; ``eps_high >
    eps_low`` is DAPO's clip-higher. Options: ``ratio_cap`` (TRL's ``delta``, INTELLECT-2)
    replaces the unclipped ``r`` by ``min(r, ratio_cap)``; ``dual_clip = c > 1`` bounds the
    loss of ``A < 0`` tokens by ``-c*A`` (Ye et al., 2020).
  * ``"reinforce"`` (GR-REINFORCE): ``-logp*A``.

Ratio level: ``"token"`` (``r = exp(logp - old_logp)`` per token) or ``"sequence"`` (GSPO:
``r = exp(mean_t(logp - old_logp))`` over the sequence's valid tokens, shared by its tokens).

Aggregations (``x`` per-token values, ``m`` the mask, ``n_i = sum_t m_it``):
  * ``"seq_mean_token_mean"``: ``sum_i (sum_t x_it m_it / max(n_i, 1)) / num_sequences``;
  * ``"token_mean"``: ``sum_it x_it m_it / num_tokens``;
  * ``"constant"``: ``sum_it x_it m_it / (num_sequences * max_completion_length)``.

On-policy distillation (``distill_coef > 0`` with a teacher's log-probs): the advantage becomes
per token, ``A_t = A + distill_coef * (teacher_logp_t - behaviour_logp_t)`` without gradient,
so the surrogate pushes each sampled token toward the teacher's probability of it: the
per-token reverse KL ``log pi_student - log pi_teacher`` on the student's own samples,
as a penalty (Thinking Machines' on-policy distillation; TRL's GKD with ``lmbda = 1``).

Rows with no valid token count in ``num_sequences`` (as in TRL) and contribute 0. The KL
term ``beta * k(ref_logp - logp)`` (``kl.py``) and the entropy bonus ``-entropy_coef * H``
are per-token values aggregated the same way as the surrogate.

Presets (``loss_type``): ``grpo`` = clip + seq_mean_token_mean (DeepSeekMath); ``dapo`` =
clip + token_mean; ``dr_grpo`` = clip + constant and advantages without std scaling (Dr.
GRPO; ``LossSpec.adv_scale``); ``gr_reinforce`` = reinforce +
seq_mean_token_mean; ``gspo`` = clip at sequence level + seq_mean_token_mean.

Lag correction (asynchronous rollouts, ``rl.max_staleness >= 1``): the batch was sampled by a
policy up to k optimizer steps older than the learner's. With ``r = exp(proximal - sampler)``
per token, no gradient (proximal: the learner's policy at the start of the step), the policy
term is weighted by ``truncated_is_weights`` (``min(r, cap)``, decoupled PPO) or
``masked_is_weights`` (``r`` inside ``[floor, cap]``, 0 outside: IcePop), the clip staying
against the proximal policy; or the ratio itself is taken against the sampler's log-probs
(plain PPO). ``jaxgrpo.rl.objective.lag_correction`` picks one and reports its weights.

Global normaliser: ``num_tokens`` and ``num_sequences`` default to the counts of the arrays
passed in. When one optimizer step is split into micro-batches or sharded over devices/hosts,
pass the counts of the **whole step** (``loss_normalizers(full_mask)``) and **sum** the
micro-batch losses and gradients: every aggregation above is then a sum of per-sequence
terms over one global constant, so the accumulated gradient equals the full-batch gradient
for every loss type. (Sequence means use each sequence's own token count, which is local
because a sequence is never split.) The same holds for ``entropy_threshold``: pass the
whole-step value from ``top_entropy_threshold`` instead of ``top_entropy_frac``. Under
``jit`` over a sharded mesh (GSPMD) the arrays already are the whole step: nothing to pass.

A run's choices are one ``Objective`` (the preset's parts and every coefficient), built once
and passed whole to ``policy_loss``. Everything is a pure, jittable function of arrays. Strings
and ``None``-able options fix the program structure (static); all numeric coefficients may be
traced, so changing them between steps never recompiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrpo.core.shapes import Array
from jaxgrpo.rl.kl import kl_estimate, warn_if_k1_in_loss
from jaxgrpo.rl.loss_spec import AGGREGATIONS, Objective


def loss_normalizers(mask: Array) -> dict[str, Array]:
    """Whole-step normalisers ``{"num_tokens", "num_sequences"}`` from the full ``[R, T]`` mask."""
    valid_RT = jnp.asarray(mask).astype(bool)
    return {
        "num_tokens": jnp.sum(valid_RT, dtype=jnp.int32),
        "num_sequences": jnp.asarray(valid_RT.shape[0], jnp.int32),
    }


def aggregate(
    x_RT: Array,
    mask_RT: Array,
    aggregation: str,
    *,
    num_tokens=None,
    num_sequences=None,
    max_completion_length=None,
) -> Array:
    """Reduce per-token values to a scalar (formulas in the module docstring).

    Args:
      x_RT: ``[R, T]`` per-token values (masked entries are ignored, even if non-finite).
      mask_RT: ``[R, T]`` valid tokens.
      aggregation: one of ``AGGREGATIONS`` (static).
      num_tokens: global valid-token count; defaults to ``sum(mask_RT)``.
      num_sequences: global sequence count; defaults to ``R``.
      max_completion_length: the constant normaliser's length; defaults to ``T``.

    Returns:
      A scalar of ``x_RT``'s dtype.
    """
    valid_RT = mask_RT.astype(bool)
    dtype = x_RT.dtype
    xm_RT = jnp.where(valid_RT, x_RT, jnp.zeros_like(x_RT))
    n_seq = jnp.asarray(x_RT.shape[0] if num_sequences is None else num_sequences, dtype)
    if aggregation == "seq_mean_token_mean":
        len_R = jnp.maximum(jnp.sum(valid_RT, axis=-1).astype(dtype), 1.0)
        return jnp.sum(jnp.sum(xm_RT, axis=-1) / len_R) / n_seq
    if aggregation == "token_mean":
        n_tok = jnp.sum(valid_RT) if num_tokens is None else num_tokens
        return jnp.sum(xm_RT) / jnp.maximum(jnp.asarray(n_tok, dtype), 1.0)
    if aggregation == "constant":
        length = x_RT.shape[1] if max_completion_length is None else max_completion_length
        return jnp.sum(xm_RT) / (n_seq * jnp.asarray(length, dtype))
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def token_entropy(logits: Array, temperature=1.0) -> Array:
    """Entropy of ``softmax(logits / temperature)`` per position, in float32 or wider.

    Args:
      logits: ``[R, T, V]`` raw logits.
      temperature: scalar or ``[R, T]`` sampling temperature (may be traced).

    Returns:
      ``[R, T]`` entropies in nats.
    """
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    temp = jnp.asarray(temperature, dtype)
    if temp.ndim:
        temp = jnp.broadcast_to(temp, logits.shape[:-1])[..., None]
    logq_RTV = jax.nn.log_softmax(logits.astype(dtype) / temp, axis=-1)
    return -jnp.sum(jnp.exp(logq_RTV) * logq_RTV, axis=-1)


def top_entropy_threshold(entropy: Array, mask: Array, frac) -> Array:
    """Entropy at or above which a token is in the top ``frac`` of valid tokens.

    The ``(1 - frac)`` quantile of the valid entries, linearly interpolated (as
    ``torch.quantile``); ``+inf`` when there is no valid token. ``frac`` may be traced.

    Args:
      entropy: ``[R, T]`` per-token entropies.
      mask: ``[R, T]`` valid tokens.
      frac: fraction of tokens to keep, in ``[0, 1]``.

    Returns:
      A scalar threshold (no gradient).
    """
    valid_RT = mask.astype(bool)
    ent_RT = jax.lax.stop_gradient(entropy)
    sorted_X = jnp.sort(jnp.where(valid_RT, ent_RT, jnp.inf).reshape(-1))
    last = jnp.maximum(jnp.sum(valid_RT) - 1, 0)
    pos = (1.0 - jnp.asarray(frac, ent_RT.dtype)) * last.astype(ent_RT.dtype)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, last)
    frac_pos = pos - lo.astype(ent_RT.dtype)
    thr = sorted_X[lo] + frac_pos * (sorted_X[hi] - sorted_X[lo])
    return jnp.where(jnp.any(valid_RT), thr, jnp.inf)


def truncated_is_weights(old_logp: Array, sampler_logp: Array, cap) -> Array:
    """Truncated importance weights ``min(exp(old_logp - sampler_logp), cap)``, no gradient.

    Corrects for the sampler's and trainer's log-probs differing for the same weights
    (numerics, precision); pass the result as ``policy_loss(..., is_weights=...)``.

    Args:
      old_logp: ``[R, T]`` trainer log-probs of the behaviour policy.
      sampler_logp: ``[R, T]`` log-probs the sampler reported for the same tokens.
      cap: upper bound on the weight (may be traced).

    Returns:
      ``[R, T]`` weights.
    """
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - sampler_logp), cap))


def masked_is_weights(old_logp: Array, sampler_logp: Array, floor, cap) -> Array:
    """Masked importance weights: ``r = exp(old_logp - sampler_logp)`` where
    ``floor <= r <= cap``, else 0; no gradient.

    IcePop's (and prime-rl's) answer to a stale or mismatched sampler: a token whose ratio left
    the band is dropped from the policy gradient rather than kept at a truncated weight, since
    its sample says little about the learner's policy; inside the band it is reweighted
    exactly. Pass the result as ``policy_loss(..., is_weights=...)``.

    Args:
      old_logp: ``[R, T]`` trainer log-probs of the proximal (learner's) policy.
      sampler_logp: ``[R, T]`` log-probs the sampler reported for the same tokens.
      floor: lower edge of the band, in ``(0, 1]`` (may be traced).
      cap: upper edge of the band, ``>= 1`` (may be traced).

    Returns:
      ``[R, T]`` weights.
    """
    ratio_RT = jnp.exp(old_logp - sampler_logp)
    keep_RT = (ratio_RT >= floor) & (ratio_RT <= cap)
    return jax.lax.stop_gradient(jnp.where(keep_RT, ratio_RT, jnp.zeros_like(ratio_RT)))


def _log_ratio_RT(logp_RT, old_RT, valid_RT, ratio_level):
    log_ratio_RT = logp_RT - old_RT
    if ratio_level == "token":
        return log_ratio_RT
    len_R = jnp.maximum(jnp.sum(valid_RT, axis=-1).astype(logp_RT.dtype), 1.0)
    seq_R = jnp.sum(log_ratio_RT, axis=-1) / len_R
    return jnp.broadcast_to(seq_R[:, None], log_ratio_RT.shape)


def _clip_surrogate(ratio_RT, adv, eps_low, eps_high, dual_clip, ratio_cap):
    """Per-token clipped loss and the low/high clip indicators; ``adv`` is [R, 1] or, with a
    distillation term, [R, T]."""
    clipped_RT = jnp.clip(ratio_RT, 1.0 - eps_low, 1.0 + eps_high)
    unclipped_RT = ratio_RT if ratio_cap is None else jnp.minimum(ratio_RT, ratio_cap)
    loss_RT = -jnp.minimum(unclipped_RT * adv, clipped_RT * adv)
    if dual_clip is not None:
        loss_RT = jnp.where(adv < 0, jnp.minimum(loss_RT, -dual_clip * adv), loss_RT)
    # PPO clips r from below only where A < 0 and from above only where A > 0.
    low_RT = (ratio_RT < 1.0 - eps_low) & (adv < 0)
    high_RT = (ratio_RT > 1.0 + eps_high) & (adv > 0)
    return loss_RT, low_RT, high_RT


def _clean(x, *, valid_RT, dtype):
    """Zero the entries outside the mask so no garbage (NaN, inf) reaches values or grads."""
    return jnp.where(valid_RT, jnp.asarray(x).astype(dtype), jnp.zeros((), dtype))


def _policy_term_RT(spec, logp_RT, old_RT, adv, valid_RT, clip_args):
    """Per-token policy-gradient loss and the ratio/clip metrics."""
    ratio_RT = jnp.exp(_log_ratio_RT(logp_RT, old_RT, valid_RT, spec.ratio_level))
    if spec.surrogate == "clip":
        pg_RT, low_RT, high_RT = _clip_surrogate(ratio_RT, adv, *clip_args)
    else:
        pg_RT = -logp_RT * adv
        low_RT = high_RT = jnp.zeros(valid_RT.shape, bool)
    metrics = _ratio_metrics(jax.lax.stop_gradient(ratio_RT), valid_RT, low_RT, high_RT)
    return pg_RT, metrics


def _masked_mean(x_RT, valid_RT):
    total = jnp.sum(jnp.where(valid_RT, x_RT, jnp.zeros_like(x_RT)))
    return total / jnp.maximum(jnp.sum(valid_RT).astype(x_RT.dtype), 1.0)


def _ratio_metrics(ratio_RT, valid_RT, low_RT, high_RT):
    dtype = ratio_RT.dtype
    return {
        "clip_frac_low": _masked_mean(low_RT.astype(dtype), valid_RT),
        "clip_frac_high": _masked_mean(high_RT.astype(dtype), valid_RT),
        "clip_frac": _masked_mean((low_RT | high_RT).astype(dtype), valid_RT),
        "ratio_mean": _masked_mean(ratio_RT, valid_RT),
        "ratio_min": jnp.min(jnp.where(valid_RT, ratio_RT, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(valid_RT, ratio_RT, -jnp.inf)),
        "num_tokens": jnp.sum(valid_RT).astype(dtype),
    }


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    objective: Objective,
    *,
    logits=None,
    temperature=1.0,
    entropy=None,
    entropy_threshold=None,
    is_weights=None,
    teacher_logp=None,
    num_tokens=None,
    num_sequences=None,
):
    """GRPO-family loss ``pg + beta * kl - entropy_coef * entropy``, each part aggregated.

    ``objective`` holds the loss's structure and coefficients; the keyword arguments are this
    call's data. Formulas, presets and the global-normaliser rule are in the module docstring.

    Args:
      logp: ``[R, T]`` log pi_theta of the sampled tokens (differentiated).
      old_logp: ``[R, T]`` behaviour-policy log-probs, or None for on-policy
        (``stop_gradient(logp)``, so ``r = 1`` with the policy gradient).
      ref_logp: ``[R, T]`` reference log-probs, or None to skip the KL term.
      advantages: ``[R]`` per-sequence advantages.
      mask: ``[R, T]`` valid completion tokens (bool or 0/1); other entries may hold garbage.
      objective: the ``Objective``.
      logits: ``[R, T, V]`` logits for the entropy, scaled by ``temperature``.
      temperature: scalar or ``[R, T]`` sampling temperature for ``logits``.
      entropy: ``[R, T]`` per-token entropy, used instead of ``logits`` when given.
      entropy_threshold: explicit threshold for the ``top_entropy_frac`` restriction
        (whole-step value from ``top_entropy_threshold``); takes precedence over
        ``objective.top_entropy_frac``.
      is_weights: ``[R, T]`` importance weights multiplied into the policy term, without
        gradient (e.g. ``truncated_is_weights`` for sampler/trainer mismatch).
      teacher_logp: ``[R, T]`` a teacher's log-probs of the sampled tokens: with
        ``objective.distill_coef``, the distillation term joins the advantage (module
        docstring); ``distill_reverse_kl`` is reported whenever it is given.
      num_tokens: whole-step valid-token count (``"token_mean"``); default: this batch's.
      num_sequences: whole-step sequence count; default: ``R``.

    Returns:
      ``(loss, metrics)``: a scalar and a dict of scalars: ``loss``, ``policy_loss``,
      ``kl_loss`` (``beta`` times the aggregated KL), ``entropy_loss``, ``kl_mean``,
      ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``, ``ratio_mean``, ``ratio_min``,
      ``ratio_max``, ``num_tokens``, with an entropy ``entropy_mean`` and
      ``frac_tokens_pg``, and with a teacher ``distill_reverse_kl`` (the mean of
      ``behaviour_logp - teacher_logp``). Means are over this batch's valid tokens.
    """
    o = objective
    spec = o.spec
    dtype = jnp.promote_types(jnp.asarray(logp).dtype, jnp.float32)
    valid_RT = jnp.asarray(mask).astype(bool)
    clean = functools.partial(_clean, valid_RT=valid_RT, dtype=dtype)
    logp_RT = clean(logp)
    old_RT = jax.lax.stop_gradient(logp_RT) if old_logp is None else clean(old_logp)
    adv = jnp.asarray(advantages).astype(dtype)[:, None]  # [R, 1], or [R, T] when distilling
    distill_RT = None
    if teacher_logp is not None:
        # Per-token reverse KL of the behaviour policy to the teacher, on the sampled tokens.
        distill_RT = jax.lax.stop_gradient(old_RT - clean(teacher_logp))
        adv = adv - o.distill_coef * distill_RT
    agg = functools.partial(
        aggregate,
        mask_RT=valid_RT,
        aggregation=spec.aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        max_completion_length=o.max_completion_length,
    )
    clip_args = (o.eps_low, o.eps_high, o.dual_clip, o.ratio_cap)
    pg_RT, metrics = _policy_term_RT(spec, logp_RT, old_RT, adv, valid_RT, clip_args)
    if is_weights is not None:
        pg_RT = pg_RT * jax.lax.stop_gradient(clean(is_weights))
    ent_RT = None
    if entropy is not None or logits is not None:
        ent_RT = clean(entropy if entropy is not None else token_entropy(logits, temperature))
        metrics["entropy_mean"] = _masked_mean(jax.lax.stop_gradient(ent_RT), valid_RT)
    if entropy_threshold is None and o.top_entropy_frac is not None:
        if ent_RT is None:
            raise ValueError("top_entropy_frac needs `logits` or `entropy`")
        entropy_threshold = top_entropy_threshold(ent_RT, valid_RT, o.top_entropy_frac)
    if entropy_threshold is not None:
        keep_RT = jax.lax.stop_gradient(ent_RT) >= entropy_threshold
        pg_RT = jnp.where(keep_RT, pg_RT, jnp.zeros_like(pg_RT))
        metrics["frac_tokens_pg"] = _masked_mean(keep_RT.astype(dtype), valid_RT)
    if distill_RT is not None:
        metrics["distill_reverse_kl"] = _masked_mean(distill_RT, valid_RT)
    metrics["policy_loss"] = agg(pg_RT)
    metrics["kl_loss"] = metrics["kl_mean"] = jnp.zeros((), dtype)
    if ref_logp is not None:
        warn_if_k1_in_loss(o.kl_estimator, o.beta)
        kl_RT = kl_estimate(logp_RT, clean(ref_logp), o.kl_estimator)
        if o.kl_bias_correction:
            kl_RT = kl_RT * jnp.exp(_log_ratio_RT(logp_RT, old_RT, valid_RT, spec.ratio_level))
        metrics["kl_loss"] = o.beta * agg(kl_RT)
        metrics["kl_mean"] = _masked_mean(jax.lax.stop_gradient(kl_RT), valid_RT)
    metrics["entropy_loss"] = jnp.zeros((), dtype)
    # A Python-literal 0 drops the term from the graph, so no backward pass runs through the
    # entropy (0 * grad is not simplified away by XLA); a traced coefficient keeps it.
    if not (isinstance(o.entropy_coef, int | float) and o.entropy_coef == 0):
        if ent_RT is None:
            raise ValueError("entropy_coef needs `logits` or `entropy`")
        metrics["entropy_loss"] = -o.entropy_coef * agg(ent_RT)
    loss = metrics["policy_loss"] + metrics["kl_loss"] + metrics["entropy_loss"]
    metrics["loss"] = loss
    metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, dtype)) for k, v in metrics.items()}
    return loss, metrics
