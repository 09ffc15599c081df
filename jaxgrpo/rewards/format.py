"""Format rewards: strict ``<answer>`` format, R1-style think/answer format, and ``format_copy``.

All three give partial credit so that a weak policy still sees reward variance within a group,
and all three punish the ``</answer> </answer> ...`` doom loop of the seed study, where a model
that learned "closing tags earn reward" repeats them until the length limit. Each grades what
the model wrote (``model_completions`` when given: with tools, never a tool's output).
"""

from __future__ import annotations

import difflib
import re

from jaxgrpo.grading.answers import graded_texts, single_answer

_OPEN, _CLOSE = "<answer>", "</answer>"
_PAIR_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EXTRA_CLOSE_COST = 0.1
_MAX_EXTRA_CLOSE_COST = 0.5
_MAX_SHAPED_CHARS = 4096  # format_copy's similarity term reads at most this much text


def repeated_close_penalty(text: str, tags: tuple[str, ...] = (_CLOSE,)) -> float:
    """``min(0.5, 0.1 * extra)`` where ``extra`` counts closing tags beyond the first per tag."""
    extra = sum(max(0, text.count(tag) - 1) for tag in tags)
    return min(_MAX_EXTRA_CLOSE_COST, _EXTRA_CLOSE_COST * extra)


def _strict_score(text: str) -> float:
    text = text.strip()
    content = single_answer(text)
    if content is not None and content.strip() and "<" not in content:
        level = 1.0 if text.startswith(_OPEN) and text.endswith(_CLOSE) else 0.5
    elif _OPEN in text or _CLOSE in text:
        level = 0.25
    else:
        level = 0.0
    return level - repeated_close_penalty(text)


def format_strict(
    prompts: list[str], completions: list[str], model_completions: list | None = None, **_
) -> list[float]:
    """Strict answer format: exactly one ``<answer>`` tag and nothing else.

    Levels (before the penalty):

    - 1.0  the stripped completion is ``<answer>X</answer>`` with non-empty, tag-free X;
    - 0.5  exactly one well-formed, non-empty pair, but with text outside it;
    - 0.25 an answer tag appears, but not as exactly one well-formed pair (unclosed, nested,
      several answers, empty);
    - 0.0  no answer tag.

    Penalty: ``repeated_close_penalty`` (0.1 per ``</answer>`` beyond the first, at most 0.5), so
    the doom loop scores below a completion with no tag at all. Range [-0.5, 1].
    """
    del prompts
    return [_strict_score(t) for t in graded_texts(completions, model_completions)]


def _r1_score(text: str) -> float:
    text = text.strip()
    think = text.count("<think>") == 1 and text.count("</think>") == 1
    think = think and text.index("<think>") < text.index("</think>")
    answer = single_answer(text) is not None
    ordered = think and answer and text.index("</think>") < text.index(_OPEN)
    exact = ordered and text.startswith("<think>") and text.endswith(_CLOSE)
    level = 0.25 * (think + answer + ordered + exact)
    return level - repeated_close_penalty(text, ("</think>", _CLOSE))


def format_r1(
    prompts: list[str], completions: list[str], model_completions: list | None = None, **_
) -> list[float]:
    """R1-style format ``<think>...</think><answer>...</answer>``, 0.25 per satisfied level:

    - one ``<think>...</think>`` pair;
    - one ``<answer>...</answer>`` pair;
    - both, with the think block closed before the answer opens;
    - all of the above, and nothing outside (starts with ``<think>``, ends with ``</answer>``).

    So only the exact shape scores 1.0. Penalty: 0.1 per repeated ``</think>`` or ``</answer>``
    beyond the first, at most 0.5. Range [-0.5, 1].
    """
    del prompts
    return [_r1_score(t) for t in graded_texts(completions, model_completions)]


def _number_re(number: str) -> re.Pattern:
    # The integer as a whole token: "42" must not match inside "142", "420", "-42" or "42.5".
    return re.compile(r"(?<![\d.\-])" + re.escape(number) + r"(?!\d|\.\d)")


def _copy_score(text: str, number: str, similarity: float = 0.0) -> float:
    text = text.strip()
    target = f"{_OPEN}{number}{_CLOSE}"
    if text == target:
        return 1.0
    pattern = _number_re(number)
    content = single_answer(text)
    appears = pattern.search(text) is not None
    tagged = content is not None
    inside = tagged and pattern.search(content) is not None
    level = 0.25 * (appears + tagged + inside)
    if not similarity:
        return level
    # Character-level match with the exact answer: dense credit for "<x>N</x>"-like wrappings
    # and for stopping early, which the four levels score the same as the bare number. The whole
    # text counts (up to a cost cap far above any completion length used here): with a short cap,
    # rambling on after "</answer>" until truncation cost nothing, and the policy stopped stopping.
    ratio = difflib.SequenceMatcher(None, text[:_MAX_SHAPED_CHARS], target, autojunk=False).ratio()
    return (1.0 - similarity) * level + similarity * ratio


def format_copy(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list,
    similarity: float = 0.0,
    model_completions: list | None = None,
    **_,
) -> list[float | None]:
    """Partial-credit reward of the ``format_copy`` task ("Copy this integer exactly: N").

    Levels, strictly ordered by quality:

    - 0.0  neither N nor a well-formed answer tag;
    - 0.25 N appears as a whole number somewhere, *or* exactly one well-formed
      ``<answer>...</answer>`` pair appears (holding something else);
    - 0.5  N appears and the pair is well-formed, but N is outside the tag;
    - 0.75 N is inside the single well-formed tag, but there is other text (or other content in
      the tag);
    - 1.0  ONLY the exact ``<answer>N</answer>``, modulo surrounding whitespace.

    Repeated or nested tags are not "well-formed", so the doom loop caps at 0.25. A missing
    reference scores None.

    ``similarity`` = s in [0, 1) mixes in a dense shaping term for every non-exact completion:
    ``(1 - s) * level + s * ratio``, where ``ratio`` in [0, 1] is difflib's character match
    ratio between the stripped completion (its first 4096 characters) and
    ``<answer>N</answer>``; it falls with every extra character, so stopping early pays. A policy
    that answers with the bare number (level 0.25, ratio ~0.25) then earns less than one that
    wraps it in some tag, e.g. ``<integer>N</integer>`` (ratio ~0.67), so the bare number is not
    a plateau; the exact form still alone scores 1.0 (ratio and level are both < 1 otherwise).
    """
    del prompts
    if not 0.0 <= similarity < 1.0:
        raise ValueError(f"format_copy similarity={similarity} is not in [0, 1)")
    rewards: list[float | None] = []
    for text, number in zip(graded_texts(completions, model_completions), answer, strict=True):
        if number is None or not str(number).strip():
            rewards.append(None)
        else:
            rewards.append(_copy_score(text, str(number).strip(), similarity))
    return rewards
