"""Strict and lenient correctness of completions, for accuracy metrics and evaluation.

Rewards are shaped (partial credit, soft similarity) and weighted, so "accuracy" cannot be
read off the reward. It is defined per task here, on the task's `answer` column:

* strict: `format_copy` counts only the exact `<answer>N</answer>` (modulo surrounding
  whitespace), the level the issue's goal is stated in; every other task with an `answer`
  column needs exactly one `<answer>` tag whose content matches the reference
  (`jaxgrpo.rewards.math.answers_match`).
* lenient: the last `<answer>` tag's content matches the reference, whatever surrounds it
  (the `exact_answer` reward).

Tasks without an `answer` column (sonnets, code) have no accuracy: both functions return None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _answers(columns: dict[str, Sequence[Any]], n: int) -> Sequence[Any] | None:
    answers = columns.get("answer")
    if answers is None or len(answers) != n:
        return None
    return answers


def strict_correct(
    task_name: str, completions: Sequence[str], columns: dict[str, Sequence[Any]]
) -> np.ndarray | None:
    """bool [N]: strictly correct completions, or None when the task has no answer column."""
    from jaxgrpo.rewards.format import single_answer
    from jaxgrpo.rewards.math import answers_match, reference_answer

    answers = _answers(columns, len(completions))
    if answers is None:
        return None
    out = np.zeros(len(completions), bool)
    for i, (text, ref) in enumerate(zip(completions, answers, strict=True)):
        if ref is None or not str(ref).strip():
            continue
        if task_name == "format_copy":
            out[i] = text.strip() == f"<answer>{str(ref).strip()}</answer>"
        else:
            content = single_answer(text)
            out[i] = content is not None and answers_match(content, reference_answer(str(ref)))
    return out


def lenient_correct(
    completions: Sequence[str], columns: dict[str, Sequence[Any]]
) -> np.ndarray | None:
    """bool [N]: the last `<answer>` tag matches the reference; None without an answer column."""
    from jaxgrpo.rewards.math import exact_answer

    answers = _answers(columns, len(completions))
    if answers is None:
        return None
    scores = exact_answer([""] * len(completions), list(completions), answer=list(answers))
    return np.asarray([s is not None and s >= 1.0 for s in scores], bool)
