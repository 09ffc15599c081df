"""Registry, curricula, hybrid rewards and RewardSet (weights, None handling, errors)."""

import importlib.util
import logging
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxgrpo.rewards import REWARDS, Curriculum, RewardSet, get_reward, reward_name
from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.combine import embedding_bleu, hard_soft
from jaxgrpo.rewards.math import exact_answer


def always_half(prompts, completions, **_):
    """A user reward importable by dotted path."""
    return [0.5] * len(completions)


def length_reward(prompts, completions, **_):
    """``len(c) / 10``: a deterministic stand-in encoder score for composition tests."""
    return [len(c) / 10 for c in completions]


def test_registry_names_dotted_paths_and_unknown_name():
    for name in (
        "exact_answer",
        "format",
        "format_copy",
        "bleu",
        "embedding",
        "perplexity",
        "embedding_bleu",
        "hard_soft",
        "sonnet_form",
        "code_tests",
        "length_penalty",
    ):
        assert callable(REWARDS[name]) and get_reward(name) is REWARDS[name]
    assert get_reward(f"{__name__}.always_half")(["p"], ["c"]) == [0.5]
    assert get_reward(f"{__name__}:always_half") is always_half
    with pytest.raises(ValueError, match="exact_answer"):  # the message lists known names
        get_reward("exact_anwser")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module.fn")
    bound = get_reward("length_penalty", max_length=10, cache_length=5)
    assert bound(["p"], ["c"], completion_lengths=[10]) == [-1.0]
    assert reward_name(bound) == "length_penalty" and reward_name(always_half) == "always_half"


@pytest.mark.parametrize(
    "spec, steps, expected",
    [
        (0.3, [0, 10**6], [0.3, 0.3]),
        ({"kind": "constant", "value": 2.0}, [5], [2.0]),
        (
            {"kind": "linear", "start": 1.0, "end": 0.0, "start_step": 10, "end_step": 110},
            [0, 10, 35, 60, 110, 500],
            [1.0, 1.0, 0.75, 0.5, 0.0, 0.0],
        ),
        (
            {"kind": "step", "start": 0.0, "end": 1.0, "end_step": 100},
            [0, 99, 100, 101],
            [0.0, 0.0, 1.0, 1.0],
        ),
        # cos(pi/4) = sqrt(2)/2, so at a quarter of the way the weight is (1 + sqrt(2)/2) / 2.
        (
            Curriculum(kind="cosine", start=1.0, end=0.0, start_step=0, end_step=100),
            [0, 25, 50, 100, 200],
            [1.0, (1 + math.sqrt(2) / 2) / 2, 0.5, 0.0, 0.0],
        ),
    ],
)
def test_curricula_values_at_given_steps(spec, steps, expected):
    curriculum = Curriculum.from_spec(spec)
    assert [curriculum(s) for s in steps] == pytest.approx(expected, abs=1e-12)


def test_curriculum_rejects_bad_specs():
    with pytest.raises(ValueError, match="known"):
        Curriculum(kind="exponential")
    with pytest.raises(ValueError, match="end_step"):
        Curriculum(kind="linear", start_step=5, end_step=5)
    with pytest.raises(ValueError, match="unknown curriculum fields"):
        Curriculum.from_spec({"kind": "step", "switch": 3})


def test_reward_set_weights_total_and_none_as_nan():
    def maybe(prompts, completions, **_):
        return [None if c == "skip" else 1.0 for c in completions]

    rewards = RewardSet(
        [("exact_answer", {"kind": "step", "start": 0.0, "end": 2.0, "end_step": 10}), (maybe, 0.5)]
    )
    completions = ["<answer>3</answer>", "skip", "<answer>4</answer>"]
    columns = {"answer": ["3", "3", "3"]}
    total, per_fn, weights = rewards(["p"] * 3, completions, columns, step=10)
    assert weights == {"exact_answer": 2.0, "maybe": 0.5}
    np.testing.assert_array_equal(per_fn["exact_answer"], np.float32([1, 0, 0]))
    np.testing.assert_array_equal(per_fn["maybe"], np.float32([1, np.nan, 1]))
    # None counts as weight 0 for its sample: 2*1 + 0.5*1, 2*0 + (none), 2*0 + 0.5*1.
    np.testing.assert_allclose(total, np.float32([2.5, 0.0, 0.5]))
    assert total.dtype == np.float32 and total.shape == (3,)
    total0, _, weights0 = rewards(["p"] * 3, completions, columns, step=0)
    assert weights0["exact_answer"] == 0.0
    np.testing.assert_allclose(total0, np.float32([0.5, 0.0, 0.5]))
    all_none, _, _ = RewardSet([(maybe, 1.0)])(["p"], ["skip"], {}, step=0)
    assert np.isnan(all_none).all()


def test_reward_set_raising_reward_scores_none_and_warns_once(caplog):
    def fragile(prompts, completions, **_):
        if any("boom" in c for c in completions):
            raise ZeroDivisionError("boom")
        return [1.0] * len(completions)

    rewards = RewardSet([(fragile, 1.0), ("format", 1.0)])
    completions = ["<answer>1</answer>", "boom here", "<answer>2</answer>"]
    with caplog.at_level(logging.WARNING):
        total, per_fn, _ = rewards(["p"] * 3, completions, {}, step=0)
        rewards(["p"] * 3, completions, {}, step=1)
    np.testing.assert_array_equal(per_fn["fragile"], np.float32([1, np.nan, 1]))
    np.testing.assert_allclose(total, np.float32([2.0, 0.0, 2.0]))
    warnings = [r for r in caplog.records if "fragile" in r.getMessage()]
    assert len(warnings) == 1, "one warning per function, naming it and the sample"
    assert "boom here" in warnings[0].getMessage() and "Sample 1" in warnings[0].getMessage()
    assert rewards.error_counts == {"fragile": 2}
    with pytest.raises(RuntimeError, match="fragile"):
        RewardSet([(fragile, 1.0)], on_error="raise")(["p"], ["boom"], {}, step=0)


def test_reward_set_wrong_length_names_the_function():
    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(ValueError, match="short.*1 values for 2"):
        RewardSet([(short, 1.0)])(["p"] * 2, ["a", "b"], {}, step=0)
    with pytest.raises(ValueError, match="column 'answer'"):
        RewardSet([("exact_answer", 1.0)])(["p"] * 2, ["a", "b"], {"answer": ["1"]}, step=0)
    with pytest.raises(ValueError, match="on_error"):
        RewardSet([("format", 1.0)], on_error="ignore")


def test_embedding_bleu_and_hard_soft_formulas():
    completions = ["<think>two plus two is four</think><answer>4</answer>", "<answer>5</answer>"]
    refs = ["two plus two is four", "two plus two is four"]
    cos = length_reward(None, completions)  # the embedding fn sees the raw completions
    got = embedding_bleu(["p"] * 2, completions, reference=refs, embedding_fn=length_reward)
    want_bleu = bleu(["p"] * 2, completions, reference=refs)
    assert got == pytest.approx([0.7 * c + 0.3 * b for c, b in zip(cos, want_bleu, strict=True)])
    hard = exact_answer(["p"] * 2, completions, answer=["4", "4"])
    got = hard_soft(
        ["p"] * 2,
        completions,
        answer=["4", "4"],
        reference=refs,
        hard_weight=0.8,
        embedding_fn=length_reward,
    )
    soft = length_reward(None, completions)
    assert hard == [1.0, 0.0]
    assert got == pytest.approx([0.8 * h + 0.2 * s for h, s in zip(hard, soft, strict=True)])
    assert hard_soft(["p"], ["x"], answer=[None], reference=["r"], embedding_fn=length_reward) == [
        None
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("jaxgrpo.rewards.embedding") is None,
    reason="jaxgrpo.rewards.embedding (tasks engineer) not present yet",
)
def test_hybrids_with_the_default_encoder():
    """Identical reasoning and reference: cos = 1 and BLEU = 1, so both hybrids give 1."""
    completion, ref = (
        "<think>the cat sat on the mat</think><answer>1</answer>",
        "the cat sat on the mat",
    )
    got = REWARDS["embedding_bleu"](["p"], [completion], reference=[ref])
    assert got[0] == pytest.approx(1.0, abs=1e-3)
    got = REWARDS["hard_soft"](["p"], [completion], answer=["1"], reference=[ref])
    assert got[0] == pytest.approx(1.0, abs=1e-3)


def test_importing_the_registry_loads_no_model():
    heavy = ("torch", "jaxgrpo.models.encoder", "jaxgrpo.rewards.perplexity")
    code = f"import sys, jaxgrpo.rewards; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
