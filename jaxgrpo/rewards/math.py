"""Answer extraction, number parsing, answer comparison and the ``exact_answer`` reward.

The hard reward of the seed study: 1 when the answer inside the completion's ``<answer>`` tag
equals the reference, else 0. Two comparisons, chosen per example by its ``verifier`` column:

* the fast path (default, GSM8K-style): lenient parsing of *one* number (thousands commas,
  currency, units, negatives, decimals, fractions, ``\\boxed{}``, unicode digits), else LaTeX
  normalisation and string equality. Leniency stops at hedging: an answer holding several
  different numbers ("3 or 4") parses to nothing and scores 0.
* ``MATH_VERIFY`` (the ``math`` and ``jeebench`` tasks): Hugging Face's math-verify, the
  verifier behind TRL's ``accuracy_reward``, which compares LaTeX symbolically (sets,
  intervals, matrices, equations, units). Two plain numbers still take the fast path. Every
  math-verify call is time-bounded and any error scores 0.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import re
import threading
import unicodedata
from fractions import Fraction

_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(
    r"(?<![\d.])-?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?(?!\d)"
)
_FRAC_SHORT_RE = re.compile(
    r"\\[dt]?frac\s*(?:(\d)|\{\s*(-?[\d.]+)\s*\})\s*(?:(\d)|\{\s*(-?[\d.]+)\s*\})"
)
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")
_DECORATION_RE = re.compile(
    r"\\left|\\right|\\[!,;:]|\\displaystyle|\^\s*\{?\s*\\circ\s*\}?|\\degree|°"
)
# Left after stripping decorations, these mean an expression ("x^2", "2\pi", "1 + 2"), not a number.
_OPERATOR_RE = re.compile(r"[\^*\\{}=×÷]|(?<=\S)\s*\+")
_CURRENCY = "$€£¥₹¢"
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_PLAIN_NUMBER_RE = re.compile(r"^\$?\s*-?\d+(?:\.\d+)?\s*\$?$")
# "$\sqrt{2}.$": sentence punctuation just inside the closing delimiter, which math-verify
# would read as part of the expression.
_INNER_PERIOD_RE = re.compile(r"\s*(?<!\.)[.,;]\s*(\$+|\\\]|\\\))\s*$")
_FINAL_PERIOD_RE = re.compile(r"(?<!\.)\.\s*$")
_DASHES = {"\u2212": "-", "\u2013": "-", "\u2014": "-", "\u2012": "-", "\ufe63": "-"}


def extract_answer(text: str) -> str | None:
    """Content of the last innermost ``<answer>...</answer>`` pair, stripped; None if absent.

    "Innermost" makes nested tags (``<answer><answer>7</answer></answer>``) yield ``7``; "last"
    means a completion with several answers is judged by its final one.
    """
    matches = _ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i].strip()
    return None


def reference_answer(reference: str) -> str:
    """The final answer of a reference: after the last ``####`` (GSM8K), else the last
    ``\\boxed{}`` (MATH solutions), else the whole string."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    boxed = last_boxed(reference)
    return boxed if boxed is not None else reference.strip()


def _ascii_digits(text: str) -> str:
    """NFKC plus any unicode decimal digit (Arabic-Indic, Devanagari, ...) mapped to ASCII."""
    text = unicodedata.normalize("NFKC", text)
    out = []
    for ch in text:
        if ch.isdigit() and not ch.isascii():
            value = unicodedata.decimal(ch, None)
            out.append(str(value) if value is not None else ch)
        else:
            out.append(_DASHES.get(ch, ch))
    return "".join(out)


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str | None) -> Fraction | None:
    """The single number a (possibly decorated) answer string states, exactly, or None.

    Handles ``\\boxed{}``, ``\\frac{a}{b}`` and ``a/b``, thousands commas (``1,234``), currency
    symbols, units and words (``12 apples``, ``5\\text{ cm}``, ``50%``, ``90^\\circ``), a leading
    ``x =``, unicode digits and minus signs. Returns None when no number is present, when the
    text states several different numbers, or when it is an expression (``x^2``, ``2\\pi``,
    ``1 + 2``).

    Args:
      text: the answer string (e.g. the content of an ``<answer>`` tag).

    Returns:
      The value as a ``Fraction`` (so ``0.5 == 1/2`` exactly), or None.
    """
    if text is None:
        return None
    boxed = last_boxed(text)
    text = _ascii_digits(boxed if boxed is not None else text)
    text = _FRAC_SHORT_RE.sub(lambda m: f"{m[1] or m[2]}/{m[3] or m[4]}", text)
    text = _DECORATION_RE.sub("", _TEXT_RE.sub(r" \1", text))
    text = text.replace("\\$", "$").replace("\\%", "%")
    text = re.sub(r"^\s*[a-zA-Z]\w*\s*=", "", text)  # "x = 5"
    if _OPERATOR_RE.search(text):
        return None
    text = _THOUSANDS_RE.sub("", text)
    for symbol in _CURRENCY:
        text = text.replace(symbol, " ")
    text = re.sub(r"-\s+(?=\d)", "-", text)  # "- 5" after stripping "$" in "-$5"
    values = {_to_fraction(m.group(0)) for m in _NUMBER_RE.finditer(text)}
    values.discard(None)
    return values.pop() if len(values) == 1 else None


def normalize_latex(text: str) -> str:
    """Canonical string form of a MATH-style answer, for comparing non-numeric answers.

    Removes ``$``, spaces, ``\\left``/``\\right``, ``\\!``/``\\,``, degrees (``^\\circ``),
    ``\\text{...}`` units, a leading ``x =``, a trailing period; maps ``\\dfrac``/``\\tfrac`` to
    ``\\frac``, ``\\frac12`` to ``\\frac{1}{2}``, ``\\sqrt2`` to ``\\sqrt{2}``, ``.5`` to ``0.5``.
    """
    text = _ascii_digits(text).strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = _DECORATION_RE.sub("", _TEXT_RE.sub(r"\1", text)).replace("$", "")
    text = text.replace("\\%", "").replace("%", "")
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"^[a-zA-Z]\w*=", "", text)  # "x=5" -> "5"
    text = re.sub(r"(?<![\d])\.(\d)", r"0.\1", text)
    text = text.rstrip(".")
    # Units written as bare words after a number ("5cm", "10inches") after removing \text.
    text = re.sub(r"^(-?[\d./]+)[a-zA-Z]+$", r"\1", text)
    return text


def answers_match(pred: str | None, ref: str) -> bool:
    """Whether a predicted answer string equals the reference answer string.

    Numeric when both sides parse to a single number (exact rational equality), else equality
    of ``normalize_latex`` forms.
    """
    if pred is None or not pred.strip():
        return False
    pred_num, ref_num = parse_number(pred), parse_number(ref)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    if ref_num is not None and pred_num is None and not re.search(r"\\|[a-zA-Z]{2}", ref):
        return False  # numeric reference, unparseable (e.g. hedged) prediction
    return normalize_latex(pred) == normalize_latex(ref)


# The ``verifier`` column value that selects math-verify (set by the math and jeebench tasks).
MATH_VERIFY = "math_verify"
# math-verify's own limit per parse and per comparison, in whole seconds (signal.alarm).
MATH_VERIFY_TIMEOUT_S = 3
# Longer answers are not parsed at all: an answer tag holding this much is not an answer.
MATH_VERIFY_MAX_CHARS = 1000
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


def _math_verify_here(pred: str, ref: str, timeout_s: int) -> bool:
    """math-verify in this thread, which must be the main one (its timeouts are signal.alarm)."""
    # Imported on first use: math-verify loads sympy and an ANTLR parser.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    try:
        gold = parse(_as_latex(ref), targets, parsing_timeout=timeout_s)
        answer = parse(_as_latex(pred), targets, parsing_timeout=timeout_s)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=timeout_s))
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

    Bounded: each parse and the comparison stop after ``timeout_s`` seconds (math-verify's own
    signal-based limit). Called from any thread but the main one, where signals cannot be
    used, the comparison runs in a worker process and is abandoned (the worker killed) after
    ``_WORKER_LIMIT_S``. A timeout, a parse failure or any other error is a mismatch.
    """
    if pred is None or not pred.strip() or len(pred) > MATH_VERIFY_MAX_CHARS:
        return False
    if threading.current_thread() is threading.main_thread():
        return _math_verify_here(pred, ref, timeout_s)
    with _worker_lock:
        future = _math_verify_worker().submit(_math_verify_here, pred, ref, timeout_s)
        try:
            return bool(future.result(timeout=_WORKER_LIMIT_S))
        except Exception:
            _stop_worker()
            return False


def verify_answer(pred: str | None, ref: str, verifier: str | None = None) -> bool:
    """Whether a predicted answer string equals the reference answer, by ``verifier``.

    ``None`` (or any other value): the fast path, ``answers_match``. ``MATH_VERIFY``: two plain
    numbers (``42``, ``-0.5``) compare exactly without sympy, anything else (LaTeX, numbers
    with units, separators or words around them) through ``math_verify_match``.
    """
    if verifier != MATH_VERIFY:
        return answers_match(pred, ref)
    if pred is None or not pred.strip():
        return False
    if _PLAIN_NUMBER_RE.match(pred.strip()) and _PLAIN_NUMBER_RE.match(ref.strip()):
        return parse_number(pred) == parse_number(ref)
    return math_verify_match(pred, ref)


def last_number(text: str) -> str | None:
    """The last whitespace-separated token of ``text`` that states a single number, or None.

    Tags are removed first, so ``<answer>25</answer>`` and ``... is 25.`` both give ``25``;
    parsing is ``parse_number`` (commas, currency, units, fractions).
    """
    text = text.replace("<answer>", " ").replace("</answer>", " ")
    for token in reversed(text.split()):
        if parse_number(token) is not None:
            return token
    return None


def exact_answer(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list,
    verifier: list | None = None,
    **_,
) -> list[float | None]:
    """Hard correctness reward.

    ``r_i = 1[verify_answer(extract_answer(c_i), reference_answer(a_i), verifier_i)]``: 1.0 when
    the content of the completion's last ``<answer>`` tag equals the reference answer, else 0.0.
    An answer stated only in the reasoning (no tags) scores 0. The reference may be a bare
    answer, a GSM8K solution (``#### 42``) or a boxed solution. A missing (None or empty)
    reference scores None. This is strict correctness (``jaxgrpo.rl.accuracy``).

    Args:
      prompts: [N] prompt strings (unused).
      completions: [N] completion strings.
      answer: [N] references (str or number).
      verifier: [N] the task's ``verifier`` column (``MATH_VERIFY`` or None); None = fast path.

    Returns:
      [N] floats in {0.0, 1.0}, or None where the reference is missing.
    """
    del prompts
    verifiers = verifier if verifier is not None else [None] * len(completions)
    rewards: list[float | None] = []
    for completion, ref, kind in zip(completions, answer, verifiers, strict=True):
        if ref is None or not str(ref).strip():
            rewards.append(None)
            continue
        pred = extract_answer(completion_text(completion))
        rewards.append(float(verify_answer(pred, reference_answer(str(ref)), kind)))
    return rewards


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list | tuple) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)
