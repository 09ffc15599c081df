"""Format rewards: strict, R1-style, format_copy's partial credit, the doom-loop penalty."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.rewards.format import format_copy, format_r1, format_strict


def _strict(text):
    return format_strict(["p"], [text])[0]


def _r1(text):
    return format_r1(["p"], [text])[0]


def _copy(text, number="4096"):
    return format_copy(["Copy this integer exactly: 4096"], [text], answer=[number])[0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>12</answer>", 1.0),
        ("  <answer>12</answer>\n", 1.0),
        ("Sure! <answer>12</answer>", 0.5),
        ("<answer>12", 0.25),  # unclosed
        ("<answer>1</answer><answer>2</answer>", 0.25 - 0.1),  # several answers
        ("<answer><answer>12</answer></answer>", 0.25 - 0.1),  # tags inside tags
        ("<answer></answer>", 0.25),  # empty
        ("12", 0.0),
    ],
)
def test_format_strict_levels(text, expected):
    assert _strict(text) == pytest.approx(expected, abs=1e-9), text


def test_format_strict_doom_loop_scores_below_no_tag():
    loop = "<answer>12</answer>" + " </answer>" * 30
    # 0.25 (not exactly one pair) minus the capped penalty 0.5.
    assert _strict(loop) == pytest.approx(-0.25)
    assert _strict(loop) < _strict("12") < _strict("<answer>12") < _strict("x <answer>12</answer>")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a</think><answer>1</answer>", 1.0),
        ("<think>a</think>\n<answer>1</answer>", 1.0),
        ("<think>a</think><answer>1</answer> bye", 0.75),  # text outside
        ("<answer>1</answer><think>a</think>", 0.5),  # wrong order
        ("<think>a</think> 1", 0.25),
        ("<answer>1</answer>", 0.25),
        ("plain text", 0.0),
        ("<think>a</think><answer>1</answer></answer></answer>", 0.25 - 0.2),
    ],
)
def test_format_r1_levels(text, expected):
    assert _r1(text) == pytest.approx(expected, abs=1e-9), text


def test_format_copy_levels_strictly_ordered_by_quality():
    ladder = [
        ("I cannot do that.", 0.0),
        ("The number is 4096.", 0.25),  # number appears
        ("<answer>4095</answer>", 0.25),  # well-formed tag, wrong number
        ("4096 <answer>409</answer>", 0.5),  # number outside the single tag
        ("Here: <answer>4096</answer>", 0.75),  # number inside, extra text
        ("<answer>copy: 4096</answer>", 0.75),  # number inside, extra content
        ("<answer>4096</answer>", 1.0),
        (" \n<answer>4096</answer>\n", 1.0),  # surrounding whitespace is fine
    ]
    scores = [_copy(text) for text, _ in ladder]
    assert scores == [expected for _, expected in ladder], list(zip(ladder, scores, strict=True))
    distinct = sorted(set(scores))
    assert distinct == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize(
    "text",
    [
        "<answer>40960</answer>",
        "<answer>14096</answer>",
        "<answer>-4096</answer>",
        "<answer>4096.5</answer>",
        "<answer> 4096 </answer>",  # whitespace inside the tag is not the exact form
        "<answer>4096</answer></answer>",  # doom loop
        "<answer><answer>4096</answer></answer>",
    ],
)
def test_format_copy_never_full_credit_for_near_misses(text):
    assert _copy(text) < 1.0, text


def test_format_copy_doom_loop_and_missing_reference():
    assert _copy("<answer>4096</answer>" + "</answer>" * 20) == 0.25
    assert format_copy(["p"], ["<answer>1</answer>"], answer=[None]) == [None]
    assert _copy("<answer>-7</answer>", number="-7") == 1.0
    assert _copy("<answer>7</answer>", number="-7") == 0.25


@settings(max_examples=60, deadline=None)
@given(number=st.integers(-(10**6), 10**6), data=st.data())
def test_format_copy_property_only_the_exact_form_scores_one(number, data):
    """For any integer, the exact tag scores 1 and any one-character edit of it scores less."""
    exact = f"<answer>{number}</answer>"
    assert _copy(exact, str(number)) == 1.0
    i = data.draw(st.integers(0, len(exact) - 1))
    ch = data.draw(st.sampled_from(list("0123456789<>/ a-")))
    edited = exact[:i] + ch + exact[i + 1 :]
    if edited.strip() != exact:
        assert _copy(edited, str(number)) < 1.0, edited
