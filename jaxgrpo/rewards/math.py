"""Answer extraction, number parsing, LaTeX normalisation and the ``exact_answer`` reward.

The hard reward of the seed study: 1 when the number inside the completion's ``<answer>`` tag
equals the reference, else 0. Real outputs need lenient parsing of *one* number (thousands
commas, currency, units, negatives, decimals, fractions, ``\\boxed{}``, unicode digits) and, for
MATH-style answers, LaTeX normalisation before a string comparison. Leniency stops at hedging:
an answer holding several different numbers ("3 or 4") parses to nothing and scores 0.
"""

from __future__ import annotations

import re
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


def exact_answer(
    prompts: list[str], completions: list[str], *, answer: list, **_
) -> list[float | None]:
    """Hard correctness reward.

    ``r_i = 1[answers_match(extract_answer(c_i), reference_answer(a_i))]``: 1.0 when the content
    of the completion's last ``<answer>`` tag equals the reference answer (numerically, or after
    LaTeX normalisation), else 0.0. An answer stated only in the reasoning (no tags) scores 0.
    The reference may be a bare answer, a GSM8K solution (``#### 42``) or a boxed solution.
    A missing (None or empty) reference scores None.

    Args:
      prompts: [N] prompt strings (unused).
      completions: [N] completion strings.
      answer: [N] references (str or number).

    Returns:
      [N] floats in {0.0, 1.0}, or None where the reference is missing.
    """
    del prompts
    rewards: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        if ref is None or not str(ref).strip():
            rewards.append(None)
            continue
        pred = extract_answer(completion_text(completion))
        rewards.append(float(answers_match(pred, reference_answer(str(ref)))))
    return rewards


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list | tuple) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)
