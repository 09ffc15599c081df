"""Independent PyTorch re-implementation of jaxgrpo's advantages and policy losses.

Written from the formulas in the issue (not from the JAX code) in a deliberately different
style: explicit per-group / per-sequence loops and boolean indexing of the valid tokens,
the way TRL's GRPOTrainer computes them. Used only by tests, in float64 and float32.
"""

from __future__ import annotations

import torch

PRESETS = {
    "grpo": ("clip", "seq_mean_token_mean", "token"),
    "dapo": ("clip", "token_mean", "token"),
    "dr_grpo": ("clip", "constant", "token"),
    "gr_reinforce": ("reinforce", "seq_mean_token_mean", "token"),
    "gspo": ("clip", "seq_mean_token_mean", "sequence"),
}


def group_advantages(rewards, group_size, scale="group", eps=1e-4, baseline="mean"):
    """Per-group loop; std is ``torch.std`` (Bessel, ddof=1); equal-reward groups give 0."""
    rewards = torch.as_tensor(rewards)
    out = torch.zeros_like(rewards)
    batch_std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    for start in range(0, rewards.numel(), group_size):
        r = rewards[start : start + group_size]
        if group_size < 2 or bool((r == r[0]).all()):
            continue  # zero-variance group: advantage stays exactly 0
        if baseline == "mean":
            base = r.mean().expand_as(r)
        else:
            base = torch.stack([torch.cat([r[:j], r[j + 1 :]]).mean() for j in range(len(r))])
        centred = r - base
        if scale == "group":
            centred = centred / (r.std() + eps)
        elif scale == "batch":
            centred = centred / (batch_std + eps)
        out[start : start + group_size] = centred
    return out


def kl_per_token(logp, ref_logp, estimator):
    """k1, k2, k3 estimators of KL(pi || pi_ref) with ``d = ref_logp - logp``."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d**2 / 2
    return torch.exp(d) - d - 1


def entropy_from_logits(logits, temperature):
    """Entropy of softmax(logits / temperature); temperature scalar or [N, T]."""
    t = torch.as_tensor(temperature, dtype=logits.dtype)
    if t.dim() == 2:
        t = t.unsqueeze(-1)
    p = torch.softmax(logits / t, dim=-1)
    return -(p * torch.log_softmax(logits / t, dim=-1)).sum(-1)


def _aggregate(per_token, mask, aggregation, num_tokens, num_sequences, max_len):
    """Loop-free TRL-style reductions (with explicit global normalisers)."""
    m = mask.to(per_token.dtype)
    if aggregation == "seq_mean_token_mean":
        per_seq = [
            per_token[i][mask[i]].sum() / max(int(mask[i].sum()), 1)
            for i in range(per_token.shape[0])
        ]
        return torch.stack(per_seq).sum() / num_sequences
    if aggregation == "token_mean":
        return (per_token * m).sum() / max(num_tokens, 1)
    return (per_token * m).sum() / (num_sequences * max_len)


def _ratio(logp, old_logp, mask, level):
    log_ratio = logp - old_logp
    if level == "sequence":
        rows = []
        for i in range(logp.shape[0]):
            n = max(int(mask[i].sum()), 1)
            rows.append((log_ratio[i] * mask[i]).sum() / n)
        log_ratio = torch.stack(rows).unsqueeze(-1).expand_as(logp)
    return torch.exp(log_ratio)


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    *,
    loss_type="grpo",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.0,
    kl_estimator="k3",
    max_completion_length=None,
    surrogate=None,
    aggregation=None,
    ratio_level=None,
    dual_clip=None,
    ratio_cap=None,
    entropy_coef=0.0,
    logits=None,
    temperature=1.0,
    entropy=None,
    top_entropy_frac=None,
    is_weights=None,
    teacher_logp=None,
    distill_coef=0.0,
    num_tokens=None,
    num_sequences=None,
):
    """Reference loss; inputs are torch tensors, ``mask`` bool. Returns ``(loss, parts)``.

    With ``teacher_logp``, every token's advantage is the sequence's plus
    ``distill_coef * (teacher_logp - behaviour_logp)``, a constant (detached)."""
    sur, agg_name, level = PRESETS[loss_type]
    sur, agg_name, level = surrogate or sur, aggregation or agg_name, ratio_level or level
    n_tok = int(mask.sum()) if num_tokens is None else num_tokens
    n_seq = mask.shape[0] if num_sequences is None else num_sequences
    max_len = mask.shape[1] if max_completion_length is None else max_completion_length
    adv = advantages.unsqueeze(1)
    if old_logp is None:
        old_logp = logp.detach()
    reverse_kl = None
    if teacher_logp is not None:
        reverse_kl = (old_logp - teacher_logp).detach()
        adv = adv + distill_coef * (teacher_logp - old_logp).detach()
    ratio = _ratio(logp, old_logp, mask, level)
    if sur == "clip":
        coef_1 = ratio if ratio_cap is None else torch.clamp(ratio, max=ratio_cap)
        coef_2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if dual_clip is not None:
            capped = torch.min(per_token, -dual_clip * adv)
            per_token = torch.where(adv < 0, capped, per_token)
    else:
        per_token = -logp * adv
    if is_weights is not None:
        per_token = per_token * is_weights
    ent = entropy
    if ent is None and logits is not None:
        ent = entropy_from_logits(logits, temperature)
    if top_entropy_frac is not None:
        thr = torch.quantile(ent.detach()[mask], 1 - top_entropy_frac)
        per_token = per_token * (ent.detach() >= thr).to(per_token.dtype)
    parts = {"policy_loss": _aggregate(per_token, mask, agg_name, n_tok, n_seq, max_len)}
    if reverse_kl is not None:
        parts["distill_reverse_kl"] = reverse_kl[mask].mean()
    loss = parts["policy_loss"]
    if ref_logp is not None:
        kl = kl_per_token(logp, ref_logp, kl_estimator)
        parts["kl_loss"] = beta * _aggregate(kl, mask, agg_name, n_tok, n_seq, max_len)
        parts["kl_mean"] = kl[mask].mean()
        loss = loss + parts["kl_loss"]
    if ent is not None:
        parts["entropy_loss"] = -entropy_coef * _aggregate(
            ent, mask, agg_name, n_tok, n_seq, max_len
        )
        parts["entropy_mean"] = ent[mask].mean()
        loss = loss + parts["entropy_loss"]
    r = ratio.detach()[mask]
    a = adv.expand_as(ratio)[mask]
    low, high = (r < 1 - eps_low) & (a < 0), (r > 1 + eps_high) & (a > 0)
    if sur != "clip":
        low, high = torch.zeros_like(low), torch.zeros_like(high)
    parts.update(
        clip_frac_low=low.to(r.dtype).mean(),
        clip_frac_high=high.to(r.dtype).mean(),
        clip_frac=(low | high).to(r.dtype).mean(),
        ratio_mean=r.mean(),
        ratio_min=r.min(),
        ratio_max=r.max(),
    )
    parts["loss"] = loss
    return loss, parts


def kl_penalized_rewards(rewards, logp, ref_logp, mask, beta):
    """``R_i - beta * sum_t (logp - ref_logp)`` over each row's valid tokens."""
    kl = torch.stack([(logp[i] - ref_logp[i])[mask[i]].sum() for i in range(len(rewards))])
    return rewards - beta * kl, kl


def lag_correction(proximal, sampler_logp, mask, mode, *, cap, floor, eps_low, eps_high):
    """A stale batch's correction: ``(old_logp for the ratio, is_weights, metrics)``.

    ``r = exp(proximal - sampler)`` per token, detached. ``"tis"``: weights ``min(r, cap)``,
    truncated where ``r > cap``; ``"mask"``: ``r`` where ``floor <= r <= cap``, else 0;
    ``"clip"``: no weights, the ratio taken against ``sampler_logp``, clipped where ``r``
    leaves ``[1 - eps_low, 1 + eps_high]``. Metrics over the valid tokens of ``mask`` only,
    gathered by boolean indexing; ``ess = (sum w)^2 / (n sum w^2)`` with ``w = r`` for clip.
    """
    r = torch.exp(proximal.detach() - sampler_logp)
    old_logp, weights = None, None
    if mode == "tis":
        weights = torch.clamp(r, max=cap)
        out = r > cap
    elif mode == "mask":
        out = (r < floor) | (r > cap)
        weights = torch.where(out, torch.zeros_like(r), r)
    else:
        old_logp = sampler_logp
        out = (r < 1 - eps_low) | (r > 1 + eps_high)
    w = (r if weights is None else weights)[mask]
    metrics = {
        "lag/is_weight_mean": w.mean(),
        "lag/is_weight_max": w.max(),
        "lag/is_clipped_frac": out[mask].to(w.dtype).mean(),
        "lag/ess": w.sum() ** 2 / (w.numel() * (w * w).sum()),
    }
    return old_logp, weights, metrics
