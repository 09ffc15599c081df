"""Evaluation figures on hand-made completions: pass@k vs enumeration, strict vs lenient, table."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo import eval_metrics as em


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the C(n, k) size-k subsets of n samples (c correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got, want = em.pass_at_k(n, c, k), _brute_pass_at_k(n, c, k)
            assert got == pytest.approx(want, abs=1e-12), (n, c, k)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 400), st.data())
def test_pass_at_k_stable_for_large_n(n, data):
    """Product form vs exact integer binomials (math.comb), far beyond float factorials."""
    import math

    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert em.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-9)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        em.pass_at_k(4, 1, 5)


def test_pass_at_all_k_averages_prompts():
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    out = em.pass_at_all_k(correct)
    assert sorted(out) == [1, 2, 3, 4]
    # pass@1 is the mean accuracy: (1/4 + 1 + 0) / 3.
    assert out[1] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    # pass@4 with n = 4: a prompt passes iff it has any correct sample -> 2/3.
    assert out[4] == pytest.approx(2 / 3)


CASES = [
    # (completion, reference, strict, lenient, formatted)
    ("<answer>25</answer>", "#### 25", True, True, True),
    ("84 - 59 = 25 rolls. <answer>25</answer>", "25", True, True, True),
    ("So 84 - 59 leaves 25 rolls.", "25", False, True, False),
    ("There are $1,234 left in total.", "1234", False, True, False),
    ("<answer>24</answer> wait, actually it is 25", "25", False, True, True),
    ("<answer>25</answer> or maybe 24", "25", True, True, True),
    ("The answer is 25 or 24", "25", False, False, False),
    ("<answer>3 or 4</answer>", "3", False, False, True),
    ("<answer></answer>", "3", False, False, False),
    ("</answer> </answer> </answer>", "3", False, False, False),
    ("<answer>B</answer>", "B", True, True, True),
    ("The correct option is \\boxed{B}", "B", False, True, False),
    ("no answer at all", None, False, False, False),
]


@pytest.mark.parametrize(("text", "ref", "strict", "lenient", "formatted"), CASES)
def test_strict_lenient_format_on_hand_made_completions(text, ref, strict, lenient, formatted):
    assert em.is_strict(text, ref) is strict
    assert em.is_lenient(text, ref) is lenient
    assert em.is_formatted(text) is formatted
    assert not (strict and not lenient), "lenient must include strict"


def test_final_number_skips_expressions_and_tags():
    assert em.final_number("x^2 is 16, so x = 4.") == "4."
    assert em.final_number("<answer>7</answer>") == "7"
    assert em.final_number("no digits here") is None


def test_tail_repeat_detects_doom_loop_only_at_the_tail():
    loop = "the answer is".split() + ["</answer>"] * 6
    assert em.tail_repeat(loop)
    assert em.tail_repeat(list(range(5)) + [7, 8, 9] * 4)
    assert not em.tail_repeat(["</answer>"] * 6 + "then a normal ending here".split())
    assert not em.tail_repeat([1, 2, 3])


def test_score_and_summarize_figures():
    refs = ["25", "7"]
    completions = [
        "<answer>25</answer>",
        "so 25",
        "<answer>3</answer>",
        "x " + "</answer> " * 10,
        "<answer>7</answer>",
        "<answer>7</answer>",
        "<answer>7</answer>",
        "7",
    ]
    lengths = [4, 3, 4, 64, 4, 5, 4, 1]
    truncated = [False, False, False, True, False, False, False, False]
    recs = em.score_samples(completions, refs, 4, lengths=lengths, truncated=truncated)
    assert [r["prompt"] for r in recs] == [0, 0, 0, 0, 1, 1, 1, 1]
    s = em.summarize(recs, 4)
    assert s["strict"] == pytest.approx(4 / 8)
    assert s["lenient"] == pytest.approx(6 / 8)
    assert s["format"] == pytest.approx(5 / 8)
    assert s["doom_loop"] == pytest.approx(1 / 8) and s["truncated"] == pytest.approx(1 / 8)
    assert s["pass@1"] == pytest.approx(s["mean@4"]) == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert s["pass@4"] == pytest.approx(1.0)
    assert s["length_correct"]["mean"] == pytest.approx((4 + 4 + 5 + 4) / 4)
    assert s["length_incorrect"]["max"] == 64


def test_score_samples_checks_counts():
    with pytest.raises(ValueError, match="3 completions for 2 prompts x 2"):
        em.score_samples(["a", "b", "c"], ["1", "2"], 2)


def test_markdown_table_side_by_side():
    def summary(strict, lenient, p8):
        return {"strict": strict, "lenient": lenient, "pass@8": p8, "num_samples": 8}

    runs = {
        "base": {"gsm8k": summary(0.5, 0.6, 0.9), "jeebench": {"strict": 0.1, "num_samples": 8}},
        "hard": {"gsm8k": summary(0.712, 0.75, 0.95)},
    }
    table = em.markdown_table(runs)
    lines = table.strip().split("\n")
    assert lines[0] == "| strategy | GSM8K strict | GSM8K lenient | GSM8K pass@8 | JEE |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| base | 50.0 | 60.0 | 90.0 | 10.0 |"
    assert lines[3] == "| hard | 71.2 | 75.0 | 95.0 | - |"


def test_markdown_table_adds_the_judge_column_when_judged():
    runs = {"a": {"gsm8k": {"strict": 0.5, "lenient": 0.5, "pass@2": 0.5, "judge": 0.25,
                            "num_samples": 2}}}  # fmt: skip
    header = em.markdown_table(runs).split("\n")[0]
    assert header.endswith("| GSM8K pass@2 | GSM8K judge |")
