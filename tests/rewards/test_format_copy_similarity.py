"""format_copy's optional dense shaping term (``similarity``): tags outrank the bare number."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.rewards.format import format_copy


def _copy(text, number="828", similarity=0.5):
    return format_copy(["p"], [text], answer=[number], similarity=similarity)[0]


def test_default_keeps_the_four_levels():
    for text, level in [("828", 0.25), ("<integer>828</integer>", 0.25), ("x", 0.0)]:
        assert format_copy(["p"], [text], answer=["828"])[0] == level, text


def test_tags_rank_above_the_bare_number_and_only_exact_scores_one():
    """The failure mode of plain-prompt GRPO: every completion the bare number (a 0.25 plateau).
    With shaping, each step towards the exact form scores strictly more."""
    ladder = [
        "828.\n\nThis integer is exactly 828",  # bare number, rambling on
        "828",  # bare number, stopped
        "<integer>828</integer>",  # some tag around it
        "<answer>828",  # the right opening tag
        "<answer>828</answer>\nDone.",  # the exact form plus extra text
        "<answer>828</answer>",
    ]
    scores = [_copy(t) for t in ladder]
    pairs = list(zip(ladder, scores, strict=True))
    assert scores == sorted(scores) and len(set(scores)) == len(scores), pairs
    assert scores[-1] == 1.0 and scores[-2] < 1.0
    assert _copy("I cannot do that.") < scores[0]


def test_similarity_range_and_missing_reference():
    assert format_copy(["p"], ["<answer>1</answer>"], answer=[None], similarity=0.5) == [None]
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="similarity"):
            _copy("828", similarity=bad)


@settings(max_examples=60, deadline=None)
@given(number=st.integers(-(10**6), 10**6), s=st.floats(0.0, 0.99), data=st.data())
def test_property_shaped_reward_in_unit_range_and_one_only_for_exact(number, s, data):
    exact = f"<answer>{number}</answer>"
    assert _copy(exact, str(number), s) == 1.0
    i = data.draw(st.integers(0, len(exact) - 1))
    ch = data.draw(st.sampled_from(list("0123456789<>/ a-")))
    edited = exact[:i] + ch + exact[i + 1 :] + data.draw(st.sampled_from(["", "\nok", "</answer>"]))
    if edited.strip() != exact:
        assert 0.0 <= _copy(edited, str(number), s) < 1.0, edited


def test_rambling_after_the_answer_costs_more_the_longer_it_goes():
    """Measured failure with a short similarity window: the policy wrote ``<answer>N</answer>``
    then XML until truncation, never the end-of-turn. Each extra line must cost reward."""
    lines = "\n<time>828</time>\n<value>828</value>\n<label>x</label>" * 3
    scores = [_copy("<answer>828</answer>" + lines[:n]) for n in (0, 6, 30, 60, len(lines))]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores), scores
