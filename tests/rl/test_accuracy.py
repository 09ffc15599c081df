"""One meaning of accuracy: strict, lenient and format on hand-made completions, and the same
numbers from the training metrics, held-out evaluation and ``jaxgrpo.evaluate``'s summary."""

import numpy as np
import pytest

from jaxgrpo.eval import metrics as eval_metrics
from jaxgrpo.grading import accuracy
from jaxgrpo.grading.verify import MATH_VERIFY
from jaxgrpo.rewards import RewardSet, reward_inputs
from jaxgrpo.rewards.math import exact_answer
from jaxgrpo.rl import step_metrics
from jaxgrpo.rl.rollout import Rollout

CASES = [
    # (completion, reference, strict, lenient, formatted)
    ("<answer>25</answer>", "#### 25", True, True, True),
    ("84 - 59 = 25 rolls. <answer>25</answer>", "25", True, True, True),
    ("Sure! <answer>7</answer>", "7", True, True, True),
    ("So 84 - 59 leaves 25 rolls.", "25", False, True, False),
    ("There are $1,234 left in total.", "1234", False, True, False),
    ("<answer>24</answer> wait, actually it is 25", "25", False, True, True),
    ("<answer>25</answer> or maybe 24", "25", True, True, True),
    ("<answer>24</answer> <answer>25</answer>", "25", True, True, False),
    ("<answer>25", "25", False, True, False),
    ("The answer is 25 or 24", "25", False, False, False),
    ("<answer>3 or 4</answer>", "3", False, False, True),
    ("<answer>8</answer>", "7", False, False, True),
    ("<answer></answer>", "3", False, False, False),
    ("</answer> </answer> </answer>", "3", False, False, False),
    ("<answer>B</answer>", "B", True, True, True),
    ("The correct option is \\boxed{B}", "B", False, False, False),
    ("no answer at all", None, False, False, False),
]


@pytest.mark.parametrize(("text", "ref", "strict", "lenient", "formatted"), CASES)
def test_strict_lenient_format_on_hand_made_completions(text, ref, strict, lenient, formatted):
    assert accuracy.is_strict(text, ref) is strict
    assert accuracy.is_lenient(text, ref) is lenient
    assert accuracy.is_formatted(text) is formatted
    assert not (strict and not lenient), "lenient includes strict"


def test_strict_is_the_exact_answer_reward_for_every_task():
    texts = [c[0] for c in CASES if c[1] is not None]
    refs = [c[1] for c in CASES if c[1] is not None]
    rewards = exact_answer([""] * len(texts), texts, answer=refs)
    for task in ("format_copy", "gsm8k", "math"):
        strict = accuracy.strict_correct(task, texts, {"answer": refs})
        np.testing.assert_array_equal(strict, np.asarray(rewards) == 1.0, err_msg=task)


def test_format_copy_counts_the_tag_not_the_surrounding_text():
    texts = ["<answer>42</answer>", " <answer>42</answer>\n", "Sure! <answer>42</answer>", "42"]
    columns = {"answer": ["42"] * 4}
    strict = accuracy.strict_correct("format_copy", texts, columns)
    np.testing.assert_array_equal(strict, [True, True, True, False])
    np.testing.assert_array_equal(accuracy.lenient_correct(texts, columns), [True] * 4)
    np.testing.assert_array_equal(accuracy.formatted(texts), [True, True, True, False])


def test_tasks_without_answers_have_no_accuracy():
    texts = ["a", "b"]
    assert accuracy.strict_correct("sonnets", texts, {"reference": ["x", "y"]}) is None
    assert accuracy.lenient_correct(texts, {"reference": ["x", "y"]}) is None
    assert accuracy.rates(texts, {"reference": ["x", "y"]}) == {}


def test_math_verify_column_gives_latex_answers_strict_credit():
    texts = ["<answer>\\frac{1}{2}</answer>", "<answer>0.5</answer>", "<answer>[0, 1)</answer>"]
    columns = {"answer": ["\\dfrac12", "\\frac{1}{2}", "[0,1)"], "verifier": [MATH_VERIFY] * 3}
    np.testing.assert_array_equal(
        accuracy.strict_correct("math", texts, columns), [True, True, True]
    )
    wrong = {"answer": ["[0,1]"], "verifier": [MATH_VERIFY]}
    assert not accuracy.strict_correct("math", texts[2:], wrong)[0]


def _rollout(examples, completions, group_size):
    n = len(completions)
    columns = {"answer": [ex["answer"] for ex in examples for _ in range(group_size)]}
    return Rollout(
        examples=examples,
        prompt_ids=np.ones((len(examples), 2), np.int32),
        prompt_mask=np.ones((len(examples), 2), np.int32),
        tokens=np.ones((n, 3), np.int32),
        mask=np.ones((n, 3), np.int32),
        logprobs=np.zeros((n, 3), np.float32),
        temps=np.ones((n, 3), np.float32),
        stop_reason=np.zeros(n, np.int32),
        lengths=np.arange(1, n + 1, dtype=np.int32),
        prompts=["p"] * n,
        completions=completions,
        rewards=np.zeros(n, np.float32),
        per_fn={},
        weights={},
        correct=accuracy.strict_correct("gsm8k", completions, columns),
    )


def test_training_held_out_and_evaluate_report_the_same_figures():
    """The same completions scored three ways: a training step's metrics, Learner.evaluate's
    (``step_metrics.eval_metrics``, logged under ``eval/``) and ``jaxgrpo.evaluate``'s summary."""
    examples = [{"messages": [], "answer": "#### 25"}, {"messages": [], "answer": "7"}]
    completions = [
        "<answer>25</answer>",
        "so 25",
        "Sure! <answer>3</answer>",
        "<answer>7</answer> and then 9",
        "<answer>7</answer> <answer>7</answer>",
        "7",
    ]
    g = 3
    train = step_metrics.step_metrics(
        _rollout(examples, completions, g), {"adv_metrics": {}}, {}, {"sampling": 1.0}
    )
    expected = {"strict_accuracy": 3 / 6, "lenient_accuracy": 5 / 6, "format_rate": 3 / 6}
    for key, value in expected.items():
        assert train[key] == pytest.approx(value), key
    assert train["completion/length_correct"] == pytest.approx((1 + 4 + 5) / 3)

    held_examples = [ex for ex in examples for _ in range(g)]
    inputs = reward_inputs(held_examples, 1, ["p"] * 6, completions, [[1]] * 6)
    held = step_metrics.eval_metrics(RewardSet([("format", 0.0)]), inputs, [False] * 6)
    records = eval_metrics.score_samples(completions, [ex["answer"] for ex in examples], g)
    summary = eval_metrics.summarize(records, g)
    for key, value in expected.items():
        assert held[key] == pytest.approx(value), key
        assert summary[key] == pytest.approx(value), key
    assert summary["pass@1"] == pytest.approx(summary["strict_accuracy"]), "pass@k is strict"
