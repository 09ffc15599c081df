"""Whether an answer equals its reference: the fast numeric path, or Hugging Face's
math-verify (the verifier behind TRL's ``accuracy_reward``), chosen per example by its
``verifier`` column.

* the fast path (default, GSM8K-style): lenient parsing of *one* number (thousands commas,
  currency, units, negatives, decimals, fractions, ``\\boxed{}``, unicode digits), else LaTeX
  normalisation and string equality. Leniency stops at hedging: an answer holding several
  different numbers ("3 or 4") parses to nothing and scores 0.
* ``MATH_VERIFY`` (the ``math`` and ``jeebench`` tasks): math-verify compares LaTeX
  symbolically (sets, intervals, matrices, equations, units). Plain prose around one number
  (``12 apples``) counts as that number, and two plain numbers still compare exactly without
  sympy. Every math-verify call is time-bounded and any error is a mismatch.

Both first drop notation that does not change a value (``answers.tidy_notation``). An answer
tag holding a whole worked solution (over ``MATH_VERIFY_MAX_CHARS``) counts as the final answer
it states (``answers.solution_answer``). With math-verify, a decimal written to 4 or 5 places
for an exact reference (``0.3333`` for ``\\frac{1}{3}``) is compared at those places.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import re
import threading

from jaxgrpo.grading.answers import (
    _PLAIN_NUMBER_RE,
    MATH_VERIFY_MAX_CHARS,
    answers_match,
    parse_number,
    prose_number,
    solution_answer,
    tidy_notation,
)

_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
# "$\sqrt{2}.$": sentence punctuation just inside the closing delimiter, which math-verify
# would read as part of the expression.
_INNER_PERIOD_RE = re.compile(r"\s*(?<!\.)[.,;]\s*(\$+|\\\]|\\\))\s*$")
_FINAL_PERIOD_RE = re.compile(r"(?<!\.)\.\s*$")
# A decimal's digits after the point ("0.3333" has 4).
_DECIMAL_PLACES_RE = re.compile(r"(?<![\d.])\d*\.(\d+)(?![\d.])")
# An answer written to fewer decimal places than math-verify's default comparison (6), but to
# at least this many, is compared at the places it is written to (``approximation_places``).
MIN_APPROXIMATION_PLACES = 4


def approximation_places(pred: str, ref: str) -> int | None:
    """The decimal places ``pred`` is written to, when it approximates an exact ``ref``.

    A decimal answer for an exact reference (a fraction, root, interval or matrix of them) is
    right when it is the reference rounded to the places it is written to: ``0.3333`` for
    ``\\frac{1}{3}``, ``(0.6, 2.6667]`` for ``(\\frac{3}{5}, \\frac{8}{3}]``. Returns those
    places (the most precise decimal's) when they are at least ``MIN_APPROXIMATION_PLACES``
    and fewer than math-verify's default 6, else None: a decimal reference is compared as
    written, and ``0.33`` or ``3.14`` are too coarse to count.
    """
    if _DECIMAL_PLACES_RE.search(ref):
        return None
    places = max((len(m.group(1)) for m in _DECIMAL_PLACES_RE.finditer(pred)), default=0)
    return places if MIN_APPROXIMATION_PLACES <= places < 6 else None


# The ``verifier`` column value that selects math-verify (set by the math and jeebench tasks).
MATH_VERIFY = "math_verify"
# math-verify's own limit per parse and per comparison, in whole seconds (signal.alarm).
MATH_VERIFY_TIMEOUT_S = 3
# Hard limit on one comparison run in the worker process (its start-up included).
_WORKER_LIMIT_S = 60.0
_worker_lock = threading.Lock()
_worker: concurrent.futures.ProcessPoolExecutor | None = None


def _as_latex(text: str) -> str:
    """``text`` in math delimiters unless it has some, so math-verify reads bare LaTeX as math;
    a trailing period inside the closing delimiter is dropped."""
    if not any(d in text for d in _LATEX_DELIMITERS):
        return f"${_FINAL_PERIOD_RE.sub('', text.strip())}$"
    return _INNER_PERIOD_RE.sub(r"\1", text.strip())


def _math_verify_here(pred: str, ref: str, timeout_s: int, places: int | None = None) -> bool:
    """math-verify in this thread, which must be the main one (its timeouts are signal.alarm);
    when the default comparison fails, again at ``places`` decimal places if given."""
    # Imported on first use: math-verify loads sympy and an ANTLR parser.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    try:
        gold = parse(_as_latex(ref), targets, parsing_timeout=timeout_s)
        answer = parse(_as_latex(pred), targets, parsing_timeout=timeout_s)
        if not (gold and answer):
            return False
        if verify(gold, answer, timeout_seconds=timeout_s):
            return True
        return places is not None and bool(
            verify(gold, answer, float_rounding=places, timeout_seconds=timeout_s)
        )
    except (Exception, TimeoutException):
        return False


def _math_verify_worker() -> concurrent.futures.ProcessPoolExecutor:
    """The one-process pool that runs math-verify for threads other than the main one."""
    global _worker
    if _worker is None:
        # spawn, not fork: the trainer's process holds JAX threads that a fork would copy.
        context = multiprocessing.get_context("spawn")
        _worker = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        atexit.register(_stop_worker)
    return _worker


def _stop_worker() -> None:
    global _worker
    if _worker is not None:
        for process in list(getattr(_worker, "_processes", {}).values()):
            process.kill()  # a comparison stuck in C code ignores a polite shutdown
        _worker.shutdown(wait=False, cancel_futures=True)
        _worker = None


def math_verify_match(pred: str | None, ref: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether math-verify finds ``pred`` equal to ``ref`` (both LaTeX or plain text).

    A decimal answer approximating an exact reference is compared at the places it is written
    to (``approximation_places``) when the default comparison fails. Bounded: each parse and
    comparison stops after ``timeout_s`` seconds (math-verify's own signal-based limit).
    Called from any thread but the main one, where signals cannot be used, the comparison runs
    in a worker process and is abandoned (the worker killed) after ``_WORKER_LIMIT_S``. A
    timeout, a parse failure or any other error is a mismatch.
    """
    if pred is None or not pred.strip() or len(pred) > MATH_VERIFY_MAX_CHARS:
        return False
    places = approximation_places(pred, ref)
    if threading.current_thread() is threading.main_thread():
        return _math_verify_here(pred, ref, timeout_s, places)
    with _worker_lock:
        future = _math_verify_worker().submit(_math_verify_here, pred, ref, timeout_s, places)
        try:
            return bool(future.result(timeout=_WORKER_LIMIT_S))
        except Exception:
            _stop_worker()
            return False


def verify_answer(pred: str | None, ref: str, verifier: str | None = None) -> bool:
    """Whether a predicted answer string equals the reference answer, by ``verifier``.

    An answer longer than ``MATH_VERIFY_MAX_CHARS`` is a whole worked solution written inside
    the tag, and counts as the final answer it states (``solution_answer``: its last
    ``\\boxed{}``, else its "final answer" sentence); one that states none scores 0. Both sides
    are then cleared of notation that does not change the value (``tidy_notation``). ``None``
    (or any other value): the fast path, ``answers_match``.
    ``MATH_VERIFY``: a plain-text answer stating one number among words counts as that number
    (``prose_number``); two plain numbers (``42``, ``-0.5``, ``18.90``) then compare exactly
    without sympy, anything else (LaTeX, numbers with units or separators) through
    ``math_verify_match``.
    """
    if pred is not None and len(pred) > MATH_VERIFY_MAX_CHARS:
        pred = solution_answer(pred)
    if pred is None or not pred.strip():
        return False
    pred, ref = tidy_notation(pred), tidy_notation(ref)
    if verifier != MATH_VERIFY:
        return answers_match(pred, ref)
    pred, ref = prose_number(pred) or pred, prose_number(ref) or ref
    if _PLAIN_NUMBER_RE.match(pred.strip()) and _PLAIN_NUMBER_RE.match(ref.strip()):
        return parse_number(pred) == parse_number(ref)
    return math_verify_match(pred, ref)
