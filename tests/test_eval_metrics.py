"""Evaluation figures on hand-made completions: pass@k vs enumeration, summaries, the table.

The per-completion strict/lenient/format definitions are tested in tests/rl/test_accuracy.py."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.eval import metrics as em


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
    assert s["strict_accuracy"] == pytest.approx(4 / 8)
    assert s["lenient_accuracy"] == pytest.approx(6 / 8)
    assert s["format_rate"] == pytest.approx(5 / 8)
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
        return {
            "strict_accuracy": strict,
            "lenient_accuracy": lenient,
            "pass@8": p8,
            "num_samples": 8,
        }

    runs = {
        "base": {
            "gsm8k": summary(0.5, 0.6, 0.9),
            "jeebench": {"strict_accuracy": 0.1, "num_samples": 8},
        },
        "hard": {"gsm8k": summary(0.712, 0.75, 0.95)},
    }
    table = em.markdown_table(runs)
    lines = table.strip().split("\n")
    assert lines[0] == "| strategy | GSM8K strict | GSM8K lenient | GSM8K pass@8 | JEE |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| base | 50.0 | 60.0 | 90.0 | 10.0 |"
    assert lines[3] == "| hard | 71.2 | 75.0 | 95.0 | - |"


def test_markdown_table_adds_the_judge_column_when_judged():
    figures = {"strict_accuracy": 0.5, "lenient_accuracy": 0.5, "pass@2": 0.5, "judge": 0.25}
    runs = {"a": {"gsm8k": {**figures, "num_samples": 2}}}
    header = em.markdown_table(runs).split("\n")[0]
    assert header.endswith("| GSM8K pass@2 | GSM8K judge |")
