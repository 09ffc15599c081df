"""Embedding-similarity reward: reasoning extraction, edge cases, and cosines from MiniLM."""

import numpy as np
import pytest

from jaxgrpo.models.encoder import default_encoder_path
from jaxgrpo.rewards import embedding as emb

REFERENCE = "She sold 48 clips in April and half as many, 24, in May, so 72 clips in total."


@pytest.fixture(scope="module")
def encoder():
    try:
        default_encoder_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return emb.load_encoder()


@pytest.mark.parametrize(
    "completion, reasoning",
    [
        ("Half is 24. <answer>72</answer>", "Half is 24."),
        ("<think>add them</think><answer>72</answer> then more", "add them then more"),
        ("a <answer>1</answer> b <answer>2</answer> c", "a b c"),
        ("reason <answer>72 and the rest never closes", "reason"),
        ("<ANSWER>5</ANSWER>", ""),
        ("no tags at all\n\n  spaced", "no tags at all spaced"),
    ],
)
def test_reasoning_text_removes_answers_and_markup(completion, reasoning):
    assert emb.reasoning_text(completion) == reasoning


def test_cosine_matches_encoder_and_ignores_the_answer(encoder):
    """r = dot of the unit embeddings of reasoning and reference; the answer tag's content
    does not move the reward; a paraphrase beats unrelated text."""
    completions = [
        f"{REFERENCE} <answer>72</answer>",
        f"{REFERENCE} <answer>99999</answer>",
        "April had 48 clips and May had half of that, 24; together 72. <answer>72</answer>",
        "The mitochondria is the powerhouse of the cell. <answer>72</answer>",
    ]
    got = emb.embedding(["p"] * 4, completions, reference=[REFERENCE] * 4)
    assert got[0] == pytest.approx(1.0, abs=1e-5)
    assert got[1] == pytest.approx(got[0], abs=1e-6)
    e = encoder.encode([emb.reasoning_text(completions[2]), REFERENCE])
    assert got[2] == pytest.approx(float(e[0] @ e[1]), abs=1e-5)
    assert got[2] > got[3] + 0.3, got


def test_missing_reference_is_none_and_empty_reasoning_is_zero(encoder):
    got = emb.embedding(
        ["p"] * 3,
        ["<answer>72</answer>", "some reasoning", "some reasoning"],
        reference=[REFERENCE, None, REFERENCE],
    )
    assert got[0] == 0.0 and got[1] is None and -1.0 <= got[2] <= 1.0
    assert emb.embedding([], [], reference=[]) == []
    with pytest.raises(ValueError, match="2 completions but 1"):
        emb.embedding(["p", "p"], ["a", "b"], reference=["r"])


def test_encoder_is_loaded_once(encoder):
    emb.embedding(["p"], ["x"], reference=["y"])
    before = emb.load_encoder.cache_info()
    emb.embedding(["p"], ["x"], reference=["y"])
    after = emb.load_encoder.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1
    assert isinstance(encoder.encode(["x", "y"]), np.ndarray)
