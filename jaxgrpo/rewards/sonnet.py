"""Shakespearean sonnet rewards: line count, ABAB CDCD EFEF GG rhyme, iambic pentameter, form.

Pronunciations come from the CMU dictionary (``pronouncing``). Words it lacks (archaic
``ow'st``, names, typos) use a documented spelling fallback, so the rewards never fail:

- rhyme key: the word's last vowel-letter group and what follows (``grow'st`` -> ``owst``);
- syllables: the number of vowel-letter groups (``aeiouy``), minus a silent final ``e``, >= 1;
- stress: unknown, so the word constrains no meter position.

A poem's lines are the completion's non-empty lines that contain a letter, with any
``<answer>``/``<think>`` tags removed; a title line such as "Sonnet 18" counts as a line, so
write the poem alone.
"""

from __future__ import annotations

import functools
import re

import pronouncing

from jaxgrpo.grading.answers import completion_text

RHYME_PAIRS = ((0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 13))
IAMBIC = "0101010101"  # stress per syllable position of a pentameter line (1 = strong)
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z']*")


def poem_lines(completion) -> list[str]:
    """The completion's non-empty lines holding a letter, tags removed."""
    text = re.sub(r"</?(?:answer|think|reasoning)>", "\n", completion_text(completion))
    return [line.strip() for line in text.splitlines() if re.search(r"[A-Za-z]", line)]


def _words(line: str) -> list[str]:
    return [w.strip("'").lower() for w in _WORD_RE.findall(line) if w.strip("'")]


@functools.lru_cache(maxsize=65536)
def _phones(word: str) -> tuple[str, ...]:
    """CMU pronunciations of ``word``, trying archaic spellings (``dimm'd`` -> ``dimmed``)."""
    candidates = [word, word.replace("'d", "ed"), word.replace("'", ""), re.sub(r"'s$", "", word)]
    for candidate in candidates:
        phones = pronouncing.phones_for_word(candidate)
        if phones:
            return tuple(phones)
    return ()


def _spelling_rhyme(word: str) -> str:
    match = re.search(r"[aeiouy]+[^aeiouy]*$", word.replace("'", ""))
    return match.group(0) if match else word


def _syllables_by_spelling(word: str) -> int:
    word = word.replace("'", "")
    groups = len(re.findall(r"[aeiouy]+", word))
    if word.endswith("e") and not word.endswith(("le", "ee")) and groups > 1:
        groups -= 1
    return max(1, groups)


def rhymes(a: str, b: str) -> float:
    """1.0 if two words rhyme, 0.5 for a slant rhyme (same final consonants), else 0.0.

    Rhyme: equal CMU rhyming parts (last stressed vowel onwards) for some pair of
    pronunciations; identical words never rhyme (so repeating one word earns nothing). Slant:
    the same consonants after the last vowel (``temperate``/``date``). Unknown words compare
    spelling rhyme keys instead (module docstring).
    """
    a, b = a.lower().strip("'"), b.lower().strip("'")
    if not a or not b or a == b:
        return 0.0
    phones_a, phones_b = _phones(a), _phones(b)
    if not phones_a or not phones_b:
        return float(_spelling_rhyme(a) == _spelling_rhyme(b))
    parts_a = {pronouncing.rhyming_part(p) for p in phones_a}
    if parts_a & {pronouncing.rhyming_part(p) for p in phones_b}:
        return 1.0
    codas_a = {_coda(p) for p in phones_a}
    return 0.5 if codas_a & ({_coda(p) for p in phones_b} - {""}) else 0.0


def _coda(phones: str) -> str:
    tail = []
    for phone in reversed(phones.split()):
        if phone[-1].isdigit():
            break
        tail.append(phone)
    return " ".join(reversed(tail))


def word_stresses(word: str) -> str:
    """Stress digits of a word, one per syllable: ``1``/``2`` stressed, ``0`` unstressed, and
    ``?`` for positions the meter should not judge (monosyllables, unknown words)."""
    phones = _phones(word)
    if not phones:
        return "?" * _syllables_by_spelling(word)
    stresses = pronouncing.stresses(phones[0])
    return "?" if len(stresses) == 1 else stresses


def line_meter(line: str) -> float:
    """Iambic-pentameter score of one line: ``syllable_score * stress_agreement``.

    ``syllable_score = max(0, 1 - |n - 10| / 5)`` for ``n`` syllables. ``stress_agreement`` is
    the fraction of judged syllables in the first 10 positions whose stress matches ``0101010101``
    (primary stress ``1`` must be on a strong position, ``0`` on a weak one; secondary ``2``,
    monosyllables and unknown words are not judged); 1.0 when nothing is judged.
    """
    pattern = "".join(word_stresses(w) for w in _words(line))
    if not pattern:
        return 0.0
    syllable_score = max(0.0, 1.0 - abs(len(pattern) - 10) / 5.0)
    judged = [(s, IAMBIC[i]) for i, s in enumerate(pattern[:10]) if s in "01"]
    agreement = sum(s == want for s, want in judged) / len(judged) if judged else 1.0
    return syllable_score * agreement


def _lines_score(lines: list[str]) -> float:
    return max(0.0, 1.0 - abs(len(lines) - 14) / 14.0)


def _rhyme_score(lines: list[str]) -> float:
    last = [(_words(line) or [""])[-1] for line in lines]
    pairs = [rhymes(last[i], last[j]) for i, j in RHYME_PAIRS if j < len(last)]
    return sum(pairs) / len(RHYME_PAIRS)


def _meter_score(lines: list[str]) -> float:
    return sum(line_meter(line) for line in lines) / max(len(lines), 14) if lines else 0.0


def sonnet_lines(prompts: list[str], completions: list[str], **_) -> list[float]:
    """``r = max(0, 1 - |n_lines - 14| / 14)``: 1.0 for exactly 14 poem lines."""
    del prompts
    return [_lines_score(poem_lines(c)) for c in completions]


def sonnet_rhyme(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Shakespearean rhyme scheme ABAB CDCD EFEF GG over the first 14 lines:
    ``r = sum(rhymes(end_i, end_j) for the 7 scheme pairs) / 7`` (missing lines score 0)."""
    del prompts
    return [_rhyme_score(poem_lines(c)[:14]) for c in completions]


def sonnet_meter(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Iambic pentameter: ``r = sum(line_meter(l)) / max(n_lines, 14)`` over all poem lines, so
    fewer than 14 lines cannot score full marks."""
    del prompts
    return [_meter_score(poem_lines(c)) for c in completions]


def sonnet_form(prompts: list[str], completions: list[str], **_) -> list[float]:
    """``r = (sonnet_lines + sonnet_rhyme + sonnet_meter) / 3``."""
    del prompts
    rewards = []
    for completion in completions:
        lines = poem_lines(completion)
        parts = (_lines_score(lines), _rhyme_score(lines[:14]), _meter_score(lines))
        rewards.append(sum(parts) / 3.0)
    return rewards
