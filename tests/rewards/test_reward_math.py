"""exact_answer: extraction, number parsing, LaTeX normalisation, adversarial completions, and
math-verify for MATH-style answers (bounded, errors score 0, usable from any thread)."""

import concurrent.futures
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.rewards.math import (
    MATH_VERIFY,
    answers_match,
    exact_answer,
    extract_answer,
    last_boxed,
    last_number,
    normalize_latex,
    parse_number,
    reference_answer,
    verify_answer,
)


def _score(completion, answer):
    return exact_answer(["q"], [completion], answer=[answer])[0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", Fraction(42)),
        ("1,234", Fraction(1234)),
        ("$1,234.50", Fraction(123450, 100)),
        ("-$5", Fraction(-5)),
        ("−7", Fraction(-7)),  # U+2212 minus sign
        ("0.5", Fraction(1, 2)),
        (".25", Fraction(1, 4)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("\\boxed{17}", Fraction(17)),
        ("12 apples", Fraction(12)),
        ("5cm", Fraction(5)),
        ("50%", Fraction(50)),
        ("€3", Fraction(3)),
        ("٤٢", Fraction(42)),  # Arabic-Indic digits
        ("４２", Fraction(42)),  # fullwidth digits (NFKC)
        ("१०", Fraction(10)),  # Devanagari digits
        ("x = 9", Fraction(9)),
        ("1e3", Fraction(1000)),
        ("5\\text{ cm}", Fraction(5)),
        ("90^\\circ", Fraction(90)),
        ("+3", Fraction(3)),
        ("12 or 12.0", Fraction(12)),  # several spellings of one value are one number
    ],
)
def test_parse_number_real_world_formats(text, expected):
    assert parse_number(text) == expected, text


@pytest.mark.parametrize(
    "text", ["", "no number", "3 or 4", "1, 2, 3", "7/0", None, "x^2", "2\\pi", "1 + 2", "2*3"]
)
def test_parse_number_rejects_missing_hedged_or_invalid(text):
    assert parse_number(text) is None, text


def test_extract_answer_last_innermost_pair():
    assert extract_answer("<answer> 7 </answer>") == "7"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("<answer><answer>7</answer></answer>") == "7"
    assert extract_answer("<answer>7") is None
    assert extract_answer("the answer is 7") is None


def test_reference_answer_gsm8k_boxed_and_plain():
    assert reference_answer("She pays 3*4=12 dollars.\n#### 1,200") == "1,200"
    assert reference_answer("so $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert reference_answer(" 18 ") == "18"
    assert last_boxed("\\boxed{\\sqrt{2}} and \\boxed{x^{2}}") == "x^{2}"


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt3}{2}"),
        ("\\left( 3, 4 \\right)", "(3,4)"),
        ("90^\\circ", "90"),
        ("10\\text{ inches}", "10"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("x = \\pi", "\\pi"),
        ("$\\frac{a}{b}$.", "\\frac{a}{b}"),
    ],
)
def test_latex_normalisation_matches_equivalent_forms(pred, ref):
    assert answers_match(pred, ref), (normalize_latex(pred), normalize_latex(ref))


@pytest.mark.parametrize(
    "pred, ref", [("\\frac{1}{3}", "\\frac{1}{2}"), ("(3,5)", "(3,4)"), ("\\sqrt{3}", "\\sqrt{2}")]
)
def test_latex_normalisation_keeps_different_answers_apart(pred, ref):
    assert not answers_match(pred, ref)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("<answer>42</answer>", "42", 1.0),
        ("Reasoning... <answer>$1,200.00</answer>", "Sum is 1200.\n#### 1,200", 1.0),
        ("<answer>\\boxed{-3}</answer>", "-3", 1.0),
        ("<answer>0.75</answer>", "\\frac{3}{4}", 1.0),
        ("<answer>٤٢</answer>", "42", 1.0),
        ("<answer>42 apples</answer>", 42, 1.0),
        ("<answer>43</answer>", "42", 0.0),
        ("<think>the answer is 42</think>", "42", 0.0),  # only in the reasoning
        ("The answer is 42.", "42", 0.0),  # no tags at all
        ("<answer>41 or 42</answer>", "42", 0.0),  # hedging
        ("<answer>42</answer> wait, <answer>41</answer>", "42", 0.0),  # last answer counts
        ("<answer>41</answer> no: <answer>42</answer>", "42", 1.0),
        ("<answer><answer>42</answer></answer>", "42", 1.0),  # tags inside tags
        ("<answer>142</answer>", "42", 0.0),
        ("<answer>-42</answer>", "42", 0.0),
        ("<answer></answer>", "42", 0.0),
        ("<answer>\\frac{\\sqrt{3}}{2}</answer>", "\\boxed{\\dfrac{\\sqrt3}{2}}", 1.0),
        ("", "42", 0.0),
    ],
)
def test_exact_answer_hand_made_and_adversarial(completion, answer, expected):
    assert _score(completion, answer) == expected, completion


def test_exact_answer_batch_none_for_missing_reference_and_conversational():
    completions = ["<answer>1</answer>", [{"role": "assistant", "content": "<answer>2</answer>"}]]
    assert exact_answer(["a", "b"], completions, answer=[None, "2"]) == [None, 1.0]
    with pytest.raises(ValueError):
        exact_answer(["a"], ["<answer>1</answer>"], answer=["1", "2"])


@settings(max_examples=60, deadline=None)
@given(
    value=st.integers(-(10**9), 10**9),
    cents=st.integers(0, 99),
    fmt=st.sampled_from(
        ["{:,}.{:02d}", "${:,}.{:02d}", "{}.{:02d} dollars", "\\boxed{{{}.{:02d}}}"]
    ),
)
def test_parse_number_property_formatted_decimals_round_trip(value, cents, fmt):
    """Any integer part with cents, written with commas/currency/units/boxed, parses exactly."""
    sign = -1 if value < 0 else 1
    text = fmt.format(value, cents)
    assert parse_number(text) == sign * (abs(value) + Fraction(cents, 100)), text


def test_last_number_skips_expressions_and_tags():
    assert last_number("x^2 is 16, so x = 4.") == "4."
    assert last_number("<answer>7</answer>") == "7"
    assert last_number("no digits here") is None


def _verified(completion, answer):
    return exact_answer(["q"], [completion], answer=[answer], verifier=[MATH_VERIFY])[0]


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("\\frac{2}{4}", "\\dfrac12"),  # LaTeX fractions, unreduced
        ("$\\frac{\\sqrt{8}}{2}$", "\\sqrt{2}"),
        ("[0, 1)", "[0,1)"),  # an interval
        ("(-\\infty, -3] \\cup [2, \\infty)", "(-\\infty,-3]\\cup[2,\\infty)"),
        ("\\{2, 1, 3\\}", "\\{1,2,3\\}"),  # a set, any order
        (
            "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
            "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        ),
        ("15\\mbox{ cm}^2", "15"),  # units
        ("5 \\text{ inches}", "5"),
        ("x = 2 - 2p", "2-2p"),
        ("12", "12"),  # two plain numbers: the fast path
    ],
)
def test_math_verify_accepts_equivalent_latex(pred, ref):
    assert _verified(f"<answer>{pred}</answer>", ref) == 1.0, (pred, ref)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("\\frac{1}{3}", "\\frac{1}{2}"),
        ("(0, 1)", "[0,1)"),
        (
            "\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}",
            "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        ),
        ("x < 5", "x > 5"),
        ("3 or 4", "4"),  # hedging
        ("AZYUK2A", "2"),
    ],
)
def test_math_verify_rejects_wrong_answers(pred, ref):
    assert _verified(f"<answer>{pred}</answer>", ref) == 0.0, (pred, ref)


@pytest.mark.parametrize(
    "pred", ["\\frac{", "\\sqrt{\\left(", "}}}{{{", "9^{9^{9^{9^{9}}}}", "x" * 5000]
)
def test_math_verify_malformed_answer_scores_zero_quickly(pred):
    start = time.perf_counter()
    assert _verified(f"<answer>{pred}</answer>", "1") == 0.0
    assert time.perf_counter() - start < 15.0, "each parse and comparison is time-bounded"


def test_math_verify_from_a_worker_thread():
    """Signal-based timeouts need the main thread; elsewhere a worker process compares."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        right = pool.submit(verify_answer, "\\frac{2}{4}", "\\frac12", MATH_VERIFY)
        wrong = pool.submit(verify_answer, "\\frac{1}{3}", "\\frac12", MATH_VERIFY)
        assert right.result(timeout=120) and not wrong.result(timeout=120)


def test_fast_path_is_the_default_for_gsm8k_style_answers():
    assert verify_answer("$1,200", "1200") and not verify_answer("\\{2,1\\}", "\\{1,2\\}")
    assert verify_answer("\\{2,1\\}", "\\{1,2\\}", MATH_VERIFY)
    assert exact_answer(["q"], ["<answer>[0, 1)</answer>"], answer=["[0,1)"]) == [1.0]
