"""MATH and MATH-500: competition problems whose solutions end in a ``\\boxed{}`` answer.

Schemas read (hub or local jsonl/json/parquet):

- MATH (e.g. EleutherAI/hendrycks_math, one config per subject): ``problem``, ``solution``
  (LaTeX, final answer in the last ``\\boxed{...}``, with any boxes written side by side
  before it: ``grading.answers.final_boxed``), ``level``, ``type``.
- MATH-500 (HuggingFaceH4/MATH-500, the default; one ``test`` split, so train/eval are split by
  content hash): the same plus an ``answer`` column, which wins over the boxed extraction.

Examples carry ``answer`` (the LaTeX answer string, not normalised: the math reward compares
both sides), ``reference`` (the full solution) and ``verifier`` = ``MATH_VERIFY``, so rewards and
accuracy compare answers with math-verify (``jaxgrpo.grading.verify.verify_answer``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, require_str
from jaxgrpo.grading.answers import final_boxed
from jaxgrpo.grading.verify import MATH_VERIFY


@dataclasses.dataclass
class MathTask(RowTask):
    """Competition math with boxed answers (MATH / MATH-500 schema)."""

    train_split: str = "test"
    eval_split: str | None = None

    name: ClassVar[str] = "math"
    columns: ClassVar[tuple[str, ...]] = ("answer", "reference", "verifier")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (
        ("exact_answer", 1.0),
        ("format", 0.2),
    )
    fixture: ClassVar[str] = "math.jsonl"
    hub_id: ClassVar[str] = "HuggingFaceH4/MATH-500"

    def to_example(self, row: Row) -> Example:
        problem = require_str(row, row.get("problem"), "problem")
        solution = require_str(row, row.get("solution"), "solution")
        answer = row.get("answer", required=False)
        if answer is None:
            answer = final_boxed(solution)
            if not answer:  # None, or an empty "\boxed{}" (two rows of MATH's train split)
                raise row.fail("field 'solution' has no \\boxed{...} answer and no 'answer' field")
        return {
            "messages": self.messages(problem),
            "answer": require_str(row, answer, "answer"),
            "reference": solution,
            "verifier": MATH_VERIFY,
        }
