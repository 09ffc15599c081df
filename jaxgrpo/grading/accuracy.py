"""The one definition of accuracy: strict, lenient and format, for every task and every reader.

Rewards are shaped (partial credit, soft similarity) and weighted, so accuracy cannot be read off
the reward. It is defined here, on the task's ``answer`` column, with the seed study's meanings,
and training metrics, held-out evaluation during training (``Learner.evaluate``) and
``python -m jaxgrpo.evaluate`` all call this module:

* strict: the content of the completion's last ``<answer>...</answer>`` tag equals the
  reference, whatever text surrounds the tag (the seed study's "the content of the <answer> tag
  matches"; the last tag, as for the ``exact_answer`` reward, so strict correctness is exactly
  ``exact_answer == 1``). The comparison is ``jaxgrpo.grading.verify.verify_answer``: the fast
  numeric path, or math-verify where the example's ``verifier`` column says so.
* lenient: strict, or the last number anywhere in the completion equals the reference (what
  the seed study's LLM judge recovered from badly formatted answers). For a non-numeric
  reference (LaTeX, option letters) lenient is strict. Lenient >= strict always.
* format: exactly one well-formed ``<answer>...</answer>`` pair (opened once, closed once, in
  that order) with non-empty content, whether or not the answer is right.

Metric names (``STRICT``, ``LENIENT``, ``FORMAT``) are the same in training logs (per step, and
under ``eval/`` held out), the evaluation JSON and Markdown, and the plots. Tasks without an
``answer`` column (sonnets, code) have no accuracy: the column functions return None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxgrpo.grading.answers import (
    completion_text,
    extract_answer,
    last_number,
    parse_number,
    reference_answer,
    single_answer,
)
from jaxgrpo.grading.verify import verify_answer

STRICT = "strict_accuracy"
LENIENT = "lenient_accuracy"
FORMAT = "format_rate"


def _reference(reference: Any) -> str | None:
    """The final answer of a reference, or None when it is missing."""
    if reference is None or not str(reference).strip():
        return None
    return reference_answer(str(reference))


def is_strict(completion: Any, reference: Any, verifier: str | None = None) -> bool:
    """The last ``<answer>`` tag's content equals the reference (False without a reference)."""
    ref = _reference(reference)
    if ref is None:
        return False
    return verify_answer(extract_answer(completion_text(completion)), ref, verifier)


def is_lenient(
    completion: Any, reference: Any, verifier: str | None = None, strict: bool | None = None
) -> bool:
    """Strict, or (numeric references only) the completion's last number equals the reference.

    Args:
      completion: the completion (a string or TRL's list of messages).
      reference: the reference answer (bare, ``#### 42`` or a boxed solution).
      verifier: the example's ``verifier`` column.
      strict: ``is_strict`` of the same completion when already known (saves a comparison).
    """
    if strict is None:
        strict = is_strict(completion, reference, verifier)
    ref = _reference(reference)
    if strict or ref is None or parse_number(ref) is None:
        return bool(strict)
    return verify_answer(last_number(completion_text(completion)), ref, verifier)


def is_formatted(completion: Any) -> bool:
    """Exactly one well-formed ``<answer>`` pair with non-empty content."""
    content = single_answer(completion_text(completion))
    return content is not None and bool(content.strip())


def _answers(columns: dict[str, Sequence[Any]], n: int) -> Sequence[Any] | None:
    answers = columns.get("answer")
    if answers is None or len(answers) != n:
        return None
    return answers


def _verifiers(columns: dict[str, Sequence[Any]], n: int) -> Sequence[Any]:
    verifiers = columns.get("verifier")
    return verifiers if verifiers is not None and len(verifiers) == n else [None] * n


def strict_correct(
    task_name: str, completions: Sequence[Any], columns: dict[str, Sequence[Any]]
) -> np.ndarray | None:
    """bool [N] ``is_strict`` per completion, or None when the task has no answer column.

    ``task_name`` does not change the definition (it is the same for every task; the example's
    ``verifier`` column picks the comparison); it stays for the rollout's call.
    """
    del task_name
    answers = _answers(columns, len(completions))
    if answers is None:
        return None
    verifiers = _verifiers(columns, len(completions))
    rows = zip(completions, answers, verifiers, strict=True)
    return np.asarray([is_strict(c, a, v) for c, a, v in rows], bool)


def lenient_correct(
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]],
    strict: np.ndarray | None = None,
) -> np.ndarray | None:
    """bool [N] ``is_lenient`` per completion, or None when the task has no answer column.

    Args:
      completions: [N] completions.
      columns: the reward columns (``answer``, optionally ``verifier``), each of length N.
      strict: [N] ``strict_correct`` of the same completions when already computed.
    """
    answers = _answers(columns, len(completions))
    if answers is None:
        return None
    verifiers = _verifiers(columns, len(completions))
    known = [None] * len(completions) if strict is None else [bool(s) for s in strict]
    rows = zip(completions, answers, verifiers, known, strict=True)
    return np.asarray([is_lenient(c, a, v, s) for c, a, v, s in rows], bool)


def formatted(completions: Sequence[Any]) -> np.ndarray:
    """bool [N] ``is_formatted`` per completion."""
    return np.asarray([is_formatted(c) for c in completions], bool)


def rates(
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]],
    strict: np.ndarray | None = None,
) -> dict[str, float]:
    """``{STRICT, LENIENT, FORMAT}`` means over N completions; ``{}`` without an answer column.

    Args:
      completions: [N] completions.
      columns: the reward columns, each of length N.
      strict: [N] ``strict_correct`` when already computed (the rollout's ``correct``).
    """
    if strict is None:
        strict = strict_correct("", completions, columns)
    if strict is None or not len(completions):
        return {}
    lenient = lenient_correct(completions, columns, strict)
    return {
        STRICT: float(np.mean(strict)),
        LENIENT: float(np.mean(lenient)),
        FORMAT: float(np.mean(formatted(completions))),
    }
