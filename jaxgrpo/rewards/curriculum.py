"""Reward weights over training steps: ``Curriculum`` ("soft first, then hard" in one line)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

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
