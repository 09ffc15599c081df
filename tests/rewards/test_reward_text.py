"""BLEU against sacrebleu, length/repetition penalties, and the sonnet rewards."""

import os

import pytest
import sacrebleu

from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.length import length_penalty, repetition_penalty
from jaxgrpo.rewards.sonnet import (
    line_meter,
    rhymes,
    sonnet_form,
    sonnet_lines,
    sonnet_meter,
    sonnet_rhyme,
)

SONNET_18 = open(
    os.path.join(os.path.dirname(__file__), "fixtures", "sonnet18.txt"), encoding="utf-8"
).read()
PROSE = (
    "The committee met on Tuesday to review the quarterly budget. After a long discussion about "
    "transportation costs, the members agreed to postpone the decision until the auditors had "
    "submitted their final report.\nSeveral participants noted that the spreadsheet contained "
    "errors in the second column, and the chair asked the treasurer to circulate a corrected "
    "version before the next meeting."
)


def test_bleu_equals_sacrebleu_sentence_bleu_over_100():
    ref = "Natalia sold 48 clips in April and half as many in May, so 72 clips in total."
    hyps = [
        ref,
        "Natalia sold 48 clips in April and 24 in May, so 72 clips.",
        "<think>She sold 48 and then 24.</think><answer>72</answer>",
        "completely unrelated words here",
        "<answer>72</answer>",  # no reasoning left
    ]
    got = bleu(["p"] * 5, hyps, reference=[ref] * 5)
    texts = [ref, hyps[1], "She sold 48 and then 24.", hyps[3]]  # reasoning_text of each
    want = [sacrebleu.sentence_bleu(t, [ref]).score / 100 for t in texts]
    assert got == pytest.approx([*want, 0.0], abs=1e-12)
    assert got[0] == pytest.approx(1.0) and got[3] < 0.1 < got[1] < 1.0
    assert bleu(["p"], ["x"], reference=[""]) == [None]


def test_length_penalty_dapo_piecewise_in_tokens():
    # L_max = 100, L_cache = 20: 0 up to 80 tokens, linear to -1 at 100, -1 beyond.
    lengths = [10, 80, 81, 90, 100, 101]
    got = length_penalty(
        ["p"] * 6, ["c"] * 6, max_length=100, cache_length=20, completion_lengths=lengths
    )
    assert got == pytest.approx([0.0, 0.0, -1 / 20, -0.5, -1.0, -1.0])
    by_ids = length_penalty(
        ["p"], ["c"], max_length=100, cache_length=20, completion_ids=[list(range(90))]
    )
    assert by_ids == pytest.approx([-0.5])
    with pytest.raises(ValueError, match="completion_ids"):
        length_penalty(["p"], ["c"])


def test_repetition_penalty():
    loop = " ".join(["the answer is"] * 20)  # 60 words, 58 trigrams, 3 unique
    got = repetition_penalty(["p"] * 3, [loop, "one two three four five", "short"])
    assert got == pytest.approx([-(1 - 3 / 58), 0.0, 0.0])


def test_rhymes_cmu_slant_fallback_and_identity():
    assert rhymes("day", "May") == 1.0
    assert rhymes("temperate", "date") == 0.5  # same final consonant, different vowel
    assert rhymes("ow'st", "grow'st") == 1.0  # both unknown to CMU: spelling fallback
    assert rhymes("day", "day") == 0.0  # repeating a word is not a rhyme
    assert rhymes("day", "night") == 0.0


def test_line_meter_pentameter_vs_prose():
    assert line_meter("But thy eternal summer shall not fade,") == pytest.approx(1.0)
    assert line_meter("Transportation costs") == 0.0  # 4 syllables, and trochaic
    assert line_meter(PROSE.splitlines()[0]) == 0.0  # far too many syllables


@pytest.mark.parametrize("fn", [sonnet_lines, sonnet_rhyme, sonnet_meter, sonnet_form])
def test_shakespeare_scores_high_and_prose_low(fn):
    sonnet, prose = fn(["Write a sonnet."] * 2, [SONNET_18, PROSE])
    assert sonnet >= 0.85, f"{fn.__name__}: Sonnet 18 scored {sonnet}"
    assert prose <= 0.15, f"{fn.__name__}: prose scored {prose}"


def test_sonnet_rewards_reject_shuffled_lines_and_repeated_line():
    lines = SONNET_18.splitlines()
    shuffled = "\n".join(lines[1:] + lines[:1])  # breaks the rhyme scheme, keeps meter
    repeated = "\n".join([lines[0]] * 14)  # perfect count, no real rhymes
    rhyme = sonnet_rhyme(["p"] * 2, [shuffled, repeated])
    assert max(rhyme) < 0.5, rhyme
    assert sonnet_lines(["p"], [repeated]) == [1.0]
