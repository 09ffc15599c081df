"""What a policy loss optimises, as values: the loss presets (``LossSpec``, ``LOSS_PRESETS``)
and a run's ``Objective``, built once from its config and passed whole to
``jaxgrpo.rl.losses.policy_loss``, whose module docstring gives the formulas."""

from __future__ import annotations

import dataclasses

from jaxgrpo.core.shapes import Array

SURROGATES = ("clip", "reinforce")
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "constant")
RATIO_LEVELS = ("token", "sequence")
# How the loss corrects for a batch sampled by an older policy (``rl.lag_correction``).
LAG_CORRECTIONS = ("tis", "mask", "clip")
STALE_BATCHES = ("wait", "drop")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The static structure of a policy loss.

    Attributes:
      surrogate: ``"clip"`` or ``"reinforce"``.
      aggregation: ``"seq_mean_token_mean"``, ``"token_mean"`` or ``"constant"``.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
      adv_scale: the advantage scaling the method is defined with (``rl.adv_scale="auto"``
        takes it): Dr. GRPO removes the std scaling along with the length normalisation.
    """

    surrogate: str
    aggregation: str
    ratio_level: str = "token"
    adv_scale: str = "group"


LOSS_PRESETS: dict[str, LossSpec] = {
    "grpo": LossSpec("clip", "seq_mean_token_mean"),
    "dapo": LossSpec("clip", "token_mean"),
    "dr_grpo": LossSpec("clip", "constant", adv_scale="none"),
    "gr_reinforce": LossSpec("reinforce", "seq_mean_token_mean"),
    "gspo": LossSpec("clip", "seq_mean_token_mean", "sequence"),
}


def resolve_spec(loss_type, surrogate=None, aggregation=None, ratio_level=None) -> LossSpec:
    """The preset ``loss_type`` with any explicitly given part overriding it."""
    if loss_type not in LOSS_PRESETS:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_PRESETS)}, got {loss_type!r}")
    base = LOSS_PRESETS[loss_type]
    spec = LossSpec(
        surrogate or base.surrogate,
        aggregation or base.aggregation,
        ratio_level or base.ratio_level,
        base.adv_scale,
    )
    for value, allowed, name in (
        (spec.surrogate, SURROGATES, "surrogate"),
        (spec.aggregation, AGGREGATIONS, "aggregation"),
        (spec.ratio_level, RATIO_LEVELS, "ratio_level"),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return spec


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a policy loss optimises: its structure and its coefficients, passed whole.

    The structure (``spec``, ``kl_estimator``, ``kl_bias_correction``, which options are None)
    is static. The numeric coefficients may be traced arrays: build the value inside the traced
    function (``dataclasses.replace(objective, beta=beta)``), and changing them never
    recompiles. Formulas are in the module docstring.

    Attributes:
      spec: surrogate, aggregation and ratio level (``resolve_spec``).
      eps_low: lower clip range, ``r >= 1 - eps_low`` where ``A < 0``.
      eps_high: upper clip range, ``r <= 1 + eps_high`` where ``A > 0``.
      beta: weight of the per-token KL term.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` with ``d = ref_logp - logp`` (see ``kl``).
      kl_bias_correction: multiply the per-token KL by the importance ratio ``r`` (with its
        gradient; token or sequence level as the ratio): TRL's ``use_bias_correction_kl``,
        the unbiased reverse-KL gradient of DeepSeek-V3.2. It changes the gradient even
        on-policy, where ``r = 1`` but ``grad r = grad logp``.
      max_completion_length: the ``"constant"`` normaliser's length; None = ``T``.
      dual_clip: ``c > 1``: the loss of ``A < 0`` tokens is at most ``-c*A``; None = off.
      ratio_cap: upper cap on the unclipped ratio, ``min(r, ratio_cap)``; None = off.
      entropy_coef: entropy bonus weight (needs an entropy); a Python 0 drops the term.
      top_entropy_frac: keep the policy-gradient term only on this fraction of the valid
        tokens with the highest entropy (KL and entropy terms stay on all tokens); None = all.
      distill_coef: on-policy distillation: each token's advantage gains
        ``distill_coef * (teacher_logp - behaviour_logp)`` without gradient, the per-token
        reverse KL to a teacher (needs ``teacher_logp``).
    """

    spec: LossSpec = LOSS_PRESETS["grpo"]
    eps_low: float | Array = 0.2
    eps_high: float | Array = 0.2
    beta: float | Array = 0.0
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    max_completion_length: int | Array | None = None
    dual_clip: float | Array | None = None
    ratio_cap: float | Array | None = None
    entropy_coef: float | Array = 0.0
    top_entropy_frac: float | Array | None = None
    distill_coef: float | Array = 0.0

    @classmethod
    def preset(
        cls,
        loss_type: str = "grpo",
        *,
        surrogate: str | None = None,
        aggregation: str | None = None,
        ratio_level: str | None = None,
        **options,
    ) -> Objective:
        """The objective of preset ``loss_type`` (a key of ``LOSS_PRESETS``), any part given
        overriding the preset's, with ``options`` the other fields."""
        return cls(resolve_spec(loss_type, surrogate, aggregation, ratio_level), **options)
