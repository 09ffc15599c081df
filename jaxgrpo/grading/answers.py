"""Answers in completions and references: extraction, notation and numbers.

Where a completion states its answer (the last ``<answer>`` tag, a reference's ``####`` line or
last ``\\boxed{}``, a whole worked solution's final statement), the notation that does not
change a value (escaped dollar signs, ``\\!`` spaces, digit-group separators), and the single
number an answer states (``parse_number``, ``prose_number``). Comparison is ``verify``; the
accuracy every reader reports is ``accuracy``; rewards and data build on all three.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
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
# What may separate boxes that state one answer together: spacing, commas, math delimiters,
# "and" (``\boxed{-2} \quad \text{and} \quad \boxed{1}``).
_BOX_JOINER_RE = re.compile(
    r"(?:\s|[,;$]|\\q?quad|\\[,;: !]|\\[()\[\]]|\\text\s*\{\s*(?:and)?\s*\}|\band\b)*"
)
# A solution's own statement of its result ("Final Answer: The final answer is $x$.").
_FINAL_ANSWER_RE = re.compile(r"final\s+answer", re.IGNORECASE)
_COPULA_RE = re.compile(r"\b(?:is|are)\b")
_DASHES = {"\u2212": "-", "\u2013": "-", "\u2014": "-", "\u2012": "-", "\ufe63": "-"}
_PLAIN_NUMBER_RE = re.compile(r"^\$?\s*-?(?:\d+(?:\.\d+)?|\.\d+)\s*\$?$")
# An escaped dollar is a currency sign ("\$18.90"), not a math delimiter.
_ESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\\\$")
# Digit groups joined by a separator that only spaces them: "32,\!348", "1{,}000", "1\,000",
# "1 000" (a bare comma is read by both checkers, and also separates lists: MATH's "1,3").
_GROUP_SEPARATOR = r"(?:\s*(?:,\s*\\!|\{\s*,\s*\}|\\[,; ])\s*| )"
_GROUPED_RE = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?!\d)")
_GROUP_SEPARATOR_RE = re.compile(_GROUP_SEPARATOR)
# Plain-text answers: LaTeX, operators, brackets or a letter touching a digit ("3i", "2x") mean
# an expression, not prose around a number.
_NOT_PROSE_RE = re.compile(r"[\\$^*+=<>!()\[\]{}|×÷]|[a-zA-Z]\d|\d[a-zA-Z]")
_WORD_RE = re.compile(r"[a-zA-Z]+")
# Words that change the quantity a number states ("3 million", "3 pi", "at least 3", "3 or 4").
_QUANTITY_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty "
    "fifty sixty seventy eighty ninety hundred thousand million billion trillion dozen half "
    "halves third thirds quarter quarters squared cubed power root sqrt pi infinity sin cos tan "
    "log ln exp plus minus times over divided not than least most or".split()
)
_OPEN, _CLOSE = "<answer>", "</answer>"
_PAIR_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Longer answers are not parsed at all: an answer tag holding this much is not an answer.
MATH_VERIFY_MAX_CHARS = 1000


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
    box = _box_at(text, start)
    return box[0] if box is not None else None


_BOX_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)(?:\s*\{|\s+([^\s{}$]+))")


def _box_at(text: str, start: int, stop: int | None = None) -> tuple[str, int] | None:
    """The content of the box command at ``text[start]`` and the index after it, or None when
    its braces do not close before ``stop`` (default: the end of ``text``). ``\\boxed 5`` (no
    braces) boxes the next token."""
    stop = len(text) if stop is None else stop
    command = _BOX_TOKEN_RE.match(text, start, stop)
    if command is None:
        return None
    if command.group(1) is not None:
        return command.group(1).rstrip("."), command.end()
    brace = command.end() - 1
    depth = 0
    for i in range(brace, stop):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i].strip(), i + 1
    return None


def final_boxed(text: str) -> str | None:
    """The last ``\\boxed{}`` of ``text`` with the boxes written side by side before it, joined
    by commas (``\\boxed{1}\\boxed{2}``, ``\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}``:
    one answer listing two values), or None without a box.

    Boxes are side by side when only spacing, commas, math delimiters or the word "and" lie
    between them; a sentence between them makes them separate statements. Joining stops
    before the answer would grow past ``MATH_VERIFY_MAX_CHARS``.
    """
    contents: list[str] = []
    length, stop = 0, len(text)
    while True:
        start = _last_box_start(text, stop)
        box = _box_at(text, start, stop) if start >= 0 else None
        if box is None:
            break
        if contents and (
            length + len(box[0]) > MATH_VERIFY_MAX_CHARS
            or not _BOX_JOINER_RE.fullmatch(text[box[1] : stop])
        ):
            break
        contents.append(box[0])
        length, stop = length + len(box[0]) + 2, start
    return ", ".join(reversed(contents)) if contents else None


def _last_box_start(text: str, stop: int) -> int:
    """Where the last ``\\boxed`` or ``\\fbox`` before ``stop`` starts, or -1; searches only
    back to the nearer of the two, so walking back box by box stays linear."""
    boxed = text.rfind("\\boxed", 0, stop)
    return max(boxed, text.rfind("\\fbox", max(boxed, 0), stop))


def reference_answer(reference: str) -> str:
    """The final answer of a reference: after the last ``####`` (GSM8K), else the last
    ``\\boxed{}`` with any boxes side by side before it (MATH solutions, ``final_boxed``), else
    the whole string."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    boxed = final_boxed(reference)
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


def tidy_notation(text: str) -> str:
    """``text`` without notation that does not change the value it states.

    Removes escaped dollar signs (``\\$18.90``: a currency sign, which math-verify would take
    for a math delimiter), ``\\!`` (a negative thin space) and the separators of digit groups
    (``32,\\!348``, ``1{,}000``, ``1\\,000``, ``1 000``). A bare comma is kept: it may separate
    the items of a list (``1,3``), and both checkers read ``1,000`` themselves.
    """
    text = _ESCAPED_DOLLAR_RE.sub("", text)
    text = _GROUPED_RE.sub(lambda m: _GROUP_SEPARATOR_RE.sub("", m.group(0)), text)
    return text.replace("\\!", "")


def prose_number(text: str) -> str | None:
    """The number a plain-text answer states among words (``12 apples``, ``It is 2/3.``).

    None unless the text is words around exactly one number: no LaTeX, operators or brackets,
    no letter touching a digit (``3i``), no one-letter word other than ``I`` (one letter may be
    a variable or ``i``), and no word that changes the quantity (``3 million``, ``3 pi``, ``at
    least 3``, ``3 or 4``).
    """
    text = _ascii_digits(text)
    words = _WORD_RE.findall(text)
    if not words or _NOT_PROSE_RE.search(text):
        return None
    if any((len(w) < 2 and w != "I") or w.lower() in _QUANTITY_WORDS for w in words):
        return None
    numbers = {m.group(0) for m in _NUMBER_RE.finditer(_THOUSANDS_RE.sub("", text))}
    return numbers.pop() if len(numbers) == 1 else None


def solution_answer(text: str) -> str | None:
    """The final answer a whole worked solution states, or None when it states none.

    Read as a reader finds it: the last ``\\boxed{}`` (with the boxes side by side before it,
    ``final_boxed``); else the solution's own statement after its last "final answer" ("Final
    Answer: The final answer is $x$. I hope it is correct." gives ``$x$``), up to the end of that
    sentence and after its last "is"/"are" ("... the domain of $f(x)$ is 19." gives ``19``).
    """
    boxed = final_boxed(text)
    if boxed is not None:
        return boxed
    said = list(_FINAL_ANSWER_RE.finditer(text))
    if not said:
        return None
    statement = _first_sentence(text[said[-1].end() :])
    if statement is None:
        return None
    statement = statement.lstrip(" \t\n:*")
    copulas = list(_COPULA_RE.finditer(statement))
    if copulas:
        statement = statement[copulas[-1].end() :]
    return statement.strip() or None


def _first_sentence(text: str) -> str | None:
    """``text`` up to its first sentence end: a period outside math (``$...$``, ``\\(...\\)``)
    followed by a space or the end, or a blank line; a decimal point is no sentence end. None
    when no sentence ends within ``MATH_VERIFY_MAX_CHARS``: that is no answer's statement."""
    in_math = False
    i = 0
    end = min(len(text), MATH_VERIFY_MAX_CHARS)
    while i < end:
        ch, pair = text[i], text[i : i + 2]
        if pair in ("\\$", "\\\\", "$$"):  # an escaped dollar, a line break, display math
            in_math = not in_math if pair == "$$" else in_math
            i += 2
            continue
        if ch == "$" or pair in ("\\(", "\\)", "\\[", "\\]"):
            in_math = not in_math if ch == "$" else pair in ("\\(", "\\[")
        elif not in_math and (
            pair == "\n\n" or (ch == "." and text[i + 1 : i + 2] in ("", " ", "\n"))
        ):
            return text[:i]
        i += 1
    return text if len(text) <= MATH_VERIFY_MAX_CHARS else None


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


def single_answer(text: str) -> str | None:
    """Content of the only ``<answer>`` pair when exactly one open and one close tag appear in
    that order (so no nesting, no repeats); None otherwise."""
    if text.count(_OPEN) != 1 or text.count(_CLOSE) != 1:
        return None
    match = _PAIR_RE.search(text)
    return match.group(1) if match else None


def completion_text(completion) -> str:
    """The text of a completion the model wrote: a string, or TRL's conversational list of
    messages, whose assistant messages' contents are joined one per line (a ``tool`` message is
    a tool's output, never the model's answer; without an assistant message, the last
    message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list | tuple) and completion and isinstance(completion[-1], dict):
        said = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        if said:
            return "\n".join(str(m.get("content") or "") for m in said)
        return str(completion[-1].get("content", ""))
    return str(completion)


def graded_texts(completions: Sequence, model_completions: Sequence[str] | None = None) -> list:
    """[N] the texts an answer or format grader reads: ``model_completions`` (what the model
    wrote, without the tools' results: ``jaxgrpo.rewards.inputs.model_texts``) when given,
    else each completion's ``completion_text``."""
    if model_completions is not None:
        if len(model_completions) != len(completions):
            raise ValueError(
                f"{len(model_completions)} model_completions for {len(completions)} completions"
            )
        return [str(t) for t in model_completions]
    return [completion_text(c) for c in completions]
