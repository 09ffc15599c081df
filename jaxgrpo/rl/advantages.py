"""Group-relative advantages: one scalar per completion from the rewards of its group.

Rows are grouped the way the sampler emits them: prompt ``b`` owns rows ``b*G .. b*G+G-1``.
Every function here is a pure, jittable function of arrays; ``group_size``, ``scale`` and
``baseline`` are static (they fix shapes and program structure), ``eps`` may be traced.

Standard-deviation convention: **Bessel-corrected (ddof=1)**, the sample standard deviation
that ``torch.Tensor.std`` (and hence TRL) uses. For a group ``[0, 1]`` it is ``sqrt(0.5)``,
not the population value ``0.5``. With ``G = 1`` there is no spread to estimate: the std is
defined as 0 and every such group counts as zero-variance.

Zero-variance groups (all rewards of the group exactly equal) carry no learning signal; their
advantages are set to exactly 0 (never NaN, and never ``0/eps`` rounding noise), and the
fraction of such groups is reported as a metric.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxgrpo.core.shapes import Array

SCALES = ("group", "batch", "none")
BASELINES = ("mean", "rloo")


def _bessel_std(x_BG: Array) -> Array:
    """Sample std over the last axis (ddof=1); 0 when the axis has a single element."""
    g = x_BG.shape[-1]
    if g < 2:
        return jnp.zeros(x_BG.shape[:-1], x_BG.dtype)
    centred_BG = x_BG - jnp.mean(x_BG, axis=-1, keepdims=True)
    return jnp.sqrt(jnp.sum(centred_BG * centred_BG, axis=-1) / (g - 1))


def _baseline_BG(r_BG: Array, baseline: str) -> Array:
    """Per-row baseline: the group mean, or the mean of the *other* G-1 rows (RLOO)."""
    g = r_BG.shape[-1]
    if baseline == "mean":
        return jnp.broadcast_to(jnp.mean(r_BG, axis=-1, keepdims=True), r_BG.shape)
    if g < 2:
        # Leave-one-out over a group of one has no other sample; those groups get 0 below.
        return r_BG
    total_B1 = jnp.sum(r_BG, axis=-1, keepdims=True)
    return (total_B1 - r_BG) / (g - 1)


def group_advantages(
    rewards: Array,
    group_size: int,
    scale: str = "group",
    eps: float | Array = 1e-4,
    *,
    baseline: str = "mean",
    return_metrics: bool = False,
):
    """Group-relative advantages for ``R = B*G`` completions.

    With ``mu_b`` the baseline of row ``i`` in group ``b`` (the group mean, or for RLOO the
    mean of the other ``G-1`` rewards of the group, ``mu_i = (sum_b - R_i) / (G-1)``):

    * ``"group"`` (GRPO): ``A_i = (R_i - mu_i) / (std_b + eps)``, ``std_b`` the group's std;
    * ``"batch"``: ``A_i = (R_i - mu_i) / (std_batch + eps)``, one std over all R rewards;
    * ``"none"`` (Dr. GRPO): ``A_i = R_i - mu_i``.

    Stds are Bessel-corrected (ddof=1, see the module docstring). Rows of a group whose
    rewards are all equal get ``A = 0`` exactly. Note that the RLOO advantage with the mean
    baseline is ``G/(G-1)`` times the mean-baseline one.

    Args:
      rewards: ``[R]`` rewards, ``R`` a multiple of ``group_size``, grouped contiguously.
      group_size: ``G``, samples per prompt (static).
      scale: ``"group"``, ``"batch"`` or ``"none"`` (static).
      eps: added to the std before dividing (may be traced).
      baseline: ``"mean"`` (group mean) or ``"rloo"`` (leave-one-out mean), static.
      return_metrics: also return a dict of scalar metrics (static).

    Returns:
      ``advantages`` ``[R]`` in the rewards' floating dtype, or ``(advantages, metrics)``
      with metrics ``frac_zero_std_groups``, ``reward_mean``, ``reward_std`` (batch, ddof=1)
      and ``reward_group_std_mean`` when ``return_metrics``.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be [R] with R a multiple of group_size={group_size}, "
            f"got shape {rewards.shape}"
        )
    dtype = jnp.promote_types(rewards.dtype, jnp.float32)
    r_BG = rewards.astype(dtype).reshape(-1, group_size)
    zero_var_B = jnp.all(r_BG == r_BG[:, :1], axis=-1) | (group_size < 2)
    centred_BG = r_BG - _baseline_BG(r_BG, baseline)
    group_std_B = _bessel_std(r_BG)
    if scale == "group":
        adv_BG = centred_BG / (group_std_B[:, None] + eps)
    elif scale == "batch":
        adv_BG = centred_BG / (_bessel_std(r_BG.reshape(-1)) + eps)
    else:
        adv_BG = centred_BG
    adv_BG = jnp.where(zero_var_B[:, None], jnp.zeros_like(adv_BG), adv_BG)
    advantages = adv_BG.reshape(-1)
    if not return_metrics:
        return advantages
    metrics = {
        "frac_zero_std_groups": jnp.mean(zero_var_B.astype(dtype)),
        "reward_mean": jnp.mean(r_BG),
        "reward_std": _bessel_std(r_BG.reshape(-1)),
        "reward_group_std_mean": jnp.mean(group_std_B),
    }
    return advantages, metrics


def rloo_advantages(rewards: Array, group_size: int) -> Array:
    """RLOO advantages ``R_i - mean_{j != i} R_j`` within each group, unscaled; ``[R] -> [R]``."""
    return group_advantages(rewards, group_size, scale="none", baseline="rloo")
