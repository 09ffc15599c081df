"""MATH and MATH-500: competition problems whose solutions end in a ``\\boxed{}`` answer.

Schemas read (hub or local jsonl/json/parquet):

- MATH (e.g. EleutherAI/hendrycks_math, one config per subject): ``problem``, ``solution``
  (LaTeX, final answer in the last ``\\boxed{...}``), ``level``, ``type``.
- MATH-500 (HuggingFaceH4/MATH-500, the default; one ``test`` split, so train/eval are split by
  content hash): the same plus an ``answer`` column, which wins over the boxed extraction.

Examples carry ``answer`` (the LaTeX answer string, not normalised: the math reward compares
both sides), ``reference`` (the full solution) and ``verifier`` = ``MATH_VERIFY``, so rewards and
accuracy compare answers with math-verify (``jaxgrpo.rewards.math.verify_answer``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, require_str
from jaxgrpo.rewards.math import MATH_VERIFY

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``) in ``text``.

    Braces are matched with a depth counter, so nested groups such as ``\\boxed{\\frac{1}{2}}``
    come back whole. Returns None when there is no complete box.
    """
    start = max(text.rfind(c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" "):  # "\boxed 5": the argument is the next token.
        token = rest.strip().split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i].strip()
    return None


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
            answer = last_boxed(solution)
            if not answer:  # None, or an empty "\boxed{}" (two rows of MATH's train split)
                raise row.fail("field 'solution' has no \\boxed{...} answer and no 'answer' field")
        return {
            "messages": self.messages(problem),
            "answer": require_str(row, answer, "answer"),
            "reference": solution,
            "verifier": MATH_VERIFY,
        }
