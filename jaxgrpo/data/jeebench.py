"""JEEBench: JEE Advanced physics, chemistry and maths questions, for evaluation only.

Schema (daman1209arora/jeebench, one ``test`` split, or a local file with the same columns):
``question``, ``gold`` (e.g. ``"B"``, ``"ACD"``, ``"3"``, ``"0.25"``), ``type`` (``MCQ``,
``MCQ(multiple)``, ``Integer``, ``Numeric``), and optionally ``subject`` and ``description``.

The question gets a type-specific line saying what the answer should look like, then the prompt
template. Examples carry ``answer`` (gold), ``type``, ``subject`` and ``verifier``: math-verify
(``MATH_VERIFY``) for numeric and integer answers, the fast path (letters compared as written)
for multiple choice. ``train_examples`` raises: the seed study uses JEEBench only to evaluate,
and training on it would leak the benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, require_str
from jaxgrpo.grading.verify import MATH_VERIFY

ANSWER_HINTS = {
    "MCQ": "Exactly one option is correct; answer with its letter.",
    "MCQ(multiple)": "One or more options are correct; answer with all their letters, e.g. ACD.",
    "Integer": "The answer is a non-negative integer.",
    "Numeric": "The answer is a number; give it to two decimal places.",
}


@dataclasses.dataclass
class JEEBenchTask(RowTask):
    """JEE Advanced benchmark questions (evaluation only)."""

    train_split: str = "test"
    eval_split: str | None = "test"
    eval_fraction: float = 0.0

    name: ClassVar[str] = "jeebench"
    columns: ClassVar[tuple[str, ...]] = ("answer", "type", "subject", "verifier")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (("exact_answer", 1.0),)
    fixture: ClassVar[str] = "jeebench.json"
    hub_id: ClassVar[str] = "daman1209arora/jeebench"

    def to_example(self, row: Row) -> Example:
        question = require_str(row, row.get("question"), "question")
        kind = require_str(row, row.get("type"), "type")
        if kind not in ANSWER_HINTS:
            raise row.fail(f"field 'type' is {kind!r}; expected one of {sorted(ANSWER_HINTS)}")
        return {
            "messages": self.messages(f"{question}\n\n{ANSWER_HINTS[kind]}"),
            "answer": require_str(row, row.get("gold"), "gold"),
            "type": kind,
            "subject": str(row.get("subject", required=False, default="")),
            "verifier": None if kind.startswith("MCQ") else MATH_VERIFY,
        }

    def _splits(self) -> tuple[list[Example], list[Example]]:
        cached = getattr(self, "_cache", None)
        if cached is None:
            rows = self._load(self.source or self.hub_id, self.eval_split or self.train_split)
            self._cache = cached = ([], rows[: self.num_eval])
        return cached

    def train_examples(self, seed: int = 0) -> list[Example]:
        """Always raises: JEEBench is an evaluation set."""
        raise ValueError(
            "jeebench is evaluation-only: train on gsm8k/math and pass jeebench to the evaluator"
        )
