"""Combining rewards: curricula (weights over training steps), hybrid rewards, and ``RewardSet``.

``RewardSet`` is what the learner calls once per step: it runs every reward function on the
batch's completions, turns ``None`` into NaN, and returns the weighted total with the weights of
that step, so "soft first, then hard" is one config line::

    RewardSet([("embedding", {"kind": "linear", "start": 1.0, "end": 0.0, "end_step": 500}),
               ("exact_answer", {"kind": "step", "start": 0.0, "end": 1.0, "end_step": 500})])
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.math import exact_answer

RewardFn = Callable[..., list]
_LOG = logging.getLogger(__name__)
CURRICULUM_KINDS = ("constant", "linear", "step", "cosine")


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """A reward weight as a function of the training step.

    - ``constant``: ``value``;
    - ``linear``: ``start`` until ``start_step``, then a straight ramp to ``end`` at
      ``end_step``, ``end`` afterwards;
    - ``step``: ``start`` before ``end_step``, ``end`` from ``end_step`` on (the switch);
    - ``cosine``: ``end + (start - end) * (1 + cos(pi * t)) / 2`` with
      ``t = clip((step - start_step) / (end_step - start_step), 0, 1)``.
    """

    kind: str = "constant"
    value: float = 1.0
    start: float = 0.0
    end: float = 1.0
    start_step: int = 0
    end_step: int = 1

    def __post_init__(self):
        if self.kind not in CURRICULUM_KINDS:
            raise ValueError(f"unknown curriculum kind {self.kind!r}; known: {CURRICULUM_KINDS}")
        if self.kind in ("linear", "cosine") and self.end_step <= self.start_step:
            raise ValueError(
                f"{self.kind} curriculum needs end_step > start_step, got "
                f"{self.start_step}..{self.end_step}"
            )

    @classmethod
    def from_spec(cls, spec: float | int | Mapping[str, Any] | Curriculum) -> Curriculum:
        """A float (constant weight), a dict of the fields, or a Curriculum."""
        if isinstance(spec, Curriculum):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"unknown curriculum fields {sorted(unknown)} in {dict(spec)}")
            return cls(**spec)
        return cls(kind="constant", value=float(spec))

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return float(self.value)
        if self.kind == "step":
            return float(self.start if step < self.end_step else self.end)
        t = min(max((step - self.start_step) / (self.end_step - self.start_step), 0.0), 1.0)
        if self.kind == "linear":
            return float(self.start + (self.end - self.start) * t)
        return float(self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * t)))


def _embedding(prompts, completions, **columns):
    # Imported on first use: the encoder loads weights, which a module import must not do.
    from jaxgrpo.rewards.embedding import embedding

    return embedding(prompts, completions, **columns)


def _mix(parts: Sequence[tuple[float, list]]) -> list[float | None]:
    out = []
    for values in zip(*(p for _, p in parts), strict=True):
        if any(v is None for v in values):
            out.append(None)
        else:
            out.append(sum(w * float(v) for (w, _), v in zip(parts, values, strict=True)))
    return out


def embedding_bleu(
    prompts: list[str],
    completions: list[str],
    *,
    reference: list,
    embedding_fn: RewardFn | None = None,
    **columns,
) -> list[float | None]:
    """The seed study's hybrid: ``r = 0.7 * cos + 0.3 * BLEU``.

    ``cos`` is the ``embedding`` reward (cosine of sentence embeddings of the reasoning and the
    reference) and ``BLEU`` the ``bleu`` reward in [0, 1]; None where either is None.
    ``embedding_fn`` replaces the default encoder reward (same signature).
    """
    cosine = (embedding_fn or _embedding)(prompts, completions, reference=reference, **columns)
    return _mix([(0.7, cosine), (0.3, bleu(prompts, completions, reference=reference))])


def hard_soft(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list,
    reference: list,
    hard_weight: float = 0.5,
    embedding_fn: RewardFn | None = None,
    **columns,
) -> list[float | None]:
    """``r = hard_weight * exact_answer + (1 - hard_weight) * embedding``; None where either is.

    Pass ``hard_weight`` with ``get_reward("hard_soft", hard_weight=0.8)``.
    """
    hard = exact_answer(prompts, completions, answer=answer)
    soft = (embedding_fn or _embedding)(prompts, completions, reference=reference, **columns)
    return _mix([(hard_weight, hard), (1.0 - hard_weight, soft)])


@dataclasses.dataclass
class _Term:
    name: str
    fn: RewardFn
    weight: Curriculum
    reported: bool = False


class RewardSet:
    """Weighted reward functions with per-step curricula and per-sample error isolation.

    ``None`` (cannot score) becomes NaN in the per-function columns and contributes nothing to
    the total, i.e. it counts as weight 0 for that sample (no renormalisation, so a sample's
    scale never depends on which other rewards could score it). A sample that no function could
    score has total NaN, which the advantage computation must exclude.

    Args:
      specs: ``(name_or_callable, weight)`` or ``(name_or_callable, weight, kwargs)`` where
        weight is a float, a ``Curriculum`` or a dict of its fields, and kwargs are bound to the
        function (``get_reward(name, **kwargs)``).
      on_error: ``"none"``: a sample whose reward raises scores None; the first failure of each
        function is logged once (a warning naming the function and the offending sample) and
        ``error_counts[name]`` counts all of them for the metrics; ``"raise"``: re-raise,
        naming the function.
    """

    def __init__(self, specs: Sequence[Sequence[Any]], on_error: str = "none"):
        from jaxgrpo.rewards import get_reward, reward_name

        if on_error not in ("none", "raise"):
            raise ValueError(f"on_error must be 'none' or 'raise', got {on_error!r}")
        self.on_error = on_error
        self.terms: list[_Term] = []
        self.error_counts: dict[str, int] = {}
        for spec in specs:
            if len(spec) not in (2, 3):
                raise ValueError(f"reward spec must be (name, weight[, kwargs]), got {spec!r}")
            target, weight = spec[0], spec[1]
            kwargs = spec[2] if len(spec) == 3 else {}
            name = reward_name(target)
            if name in {t.name for t in self.terms}:
                name = f"{name}#{len(self.terms)}"
            fn = get_reward(target, **kwargs)
            self.terms.append(_Term(name, fn, Curriculum.from_spec(weight)))

    def weights(self, step: int) -> dict[str, float]:
        """Each function's weight at ``step``."""
        return {t.name: t.weight(step) for t in self.terms}

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        step: int = 0,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Scores a batch.

        Args:
          prompts: [N] prompt strings.
          completions: [N] completion strings.
          columns: task columns, each a length-N sequence (e.g. ``answer``, ``reference``).
          step: the training step, for curricula.

        Returns:
          ``(total [N] float32, per_fn {name: [N] float32 with NaN for None}, weights {name:
          float})``.
        """
        columns = dict(columns or {})
        n = len(completions)
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
        weights = self.weights(step)
        per_fn = {t.name: self._score(t, prompts, completions, columns) for t in self.terms}
        scored = np.zeros((n,), np.bool_)
        total = np.zeros((n,), np.float32)
        for name, values in per_fn.items():
            ok = ~np.isnan(values)
            scored |= ok
            total += np.where(ok, np.float32(weights[name]) * values, np.float32(0.0))
        total = np.where(scored, total, np.float32(np.nan)).astype(np.float32)
        return total, per_fn, weights

    def _score(self, term: _Term, prompts, completions, columns) -> np.ndarray:
        n = len(completions)
        try:
            values = term.fn(prompts, completions, **columns)
        except Exception as error:
            if self.on_error == "raise":
                raise RuntimeError(f"reward function {term.name!r} raised: {error!r}") from error
            values = self._score_one_by_one(term, prompts, completions, columns)
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {term.name!r} returned {got} for {n} completions")
        return np.array([np.nan if v is None else float(v) for v in values], np.float32)

    def _score_one_by_one(self, term: _Term, prompts, completions, columns) -> list:
        """Re-runs a failed batch per sample so only the offending samples score None."""
        values, failed = [], []
        for i in range(len(completions)):
            one = {k: [v[i]] for k, v in columns.items()}
            try:
                result = term.fn([prompts[i]], [completions[i]], **one)
                if len(result) != 1:
                    raise ValueError(f"returned {len(result)} values for 1 completion")
                values.append(result[0])
            except Exception as error:
                failed.append((i, error))
                values.append(None)
        if failed:
            self.error_counts[term.name] = self.error_counts.get(term.name, 0) + len(failed)
        if failed and not term.reported:
            term.reported = True
            i, error = failed[0]
            _LOG.warning(
                "reward function %r raised on %d of %d samples; they score None (further "
                "failures are only counted in error_counts). Sample %d, error %r, completion %r",
                term.name,
                len(failed),
                len(completions),
                i,
                error,
                str(completions[i])[:500],
            )
        return values
