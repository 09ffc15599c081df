"""The arithmetic task: seeded, disjoint train/eval, answers that follow from their reasoning."""

import re

import pytest

from jaxgrpo.data import get_task
from jaxgrpo.data.base import prompt_key


def test_answers_equal_the_last_step_of_the_reasoning_and_sets_are_disjoint():
    task = get_task("arithmetic", num_train=300, num_eval=40, ops=3, max_number=15)
    train, held_out = task.train_examples(0), task.eval_examples()
    assert len(train) == 300 and len(held_out) == 40
    assert not {prompt_key(e) for e in train} & {prompt_key(e) for e in held_out}
    for ex in train + held_out:
        # Every "a op b = c" in the reasoning is true, and the answer is the last result.
        results = []
        for a, op, b, c in re.findall(r"(\d+) ([+*-]) (\d+) = (\d+)", ex["reference"]):
            assert eval(f"{a} {op} {b}") == int(c), ex["reference"]
            results.append(c)
        assert results and results[-1] == ex["answer"]
        assert int(ex["answer"]) >= 0
    assert task.train_examples(0) == train and task.train_examples(1) != train
    assert get_task("arithmetic", num_eval=40, ops=3, max_number=15).eval_examples() == held_out
    # A larger held-out set starts with the smaller one and is still disjoint from training.
    larger = get_task("arithmetic", num_eval=200, ops=3, max_number=15).eval_examples()
    assert larger[:40] == held_out
    assert not {prompt_key(e) for e in train} & {prompt_key(e) for e in larger}


def test_worked_example_is_a_previous_turn_with_the_tag():
    ex = get_task("arithmetic", num_eval=2, worked_example=True).eval_examples()[0]
    roles = [m["role"] for m in ex["messages"]]
    assert roles == ["user", "assistant", "user"]
    assert ex["messages"][1]["content"].endswith("<answer>17</answer>")


def test_the_worked_example_can_compute_with_the_calculator():
    """With ``worked_calc`` the solved example calls ``calc`` in the tag format and shows its
    result, which is what ``calc`` returns for that expression."""
    from jaxgrpo.agents import Toolbox, calc, get_format

    ex = get_task("arithmetic", num_eval=2, worked_example=True, worked_calc=True)
    solved = ex.eval_examples()[0]["messages"][-2]["content"]
    fmt = get_format("tag", Toolbox([calc]).schemas)
    (call,) = fmt.parse(solved)
    assert call.arguments == {"expression": "4*3+5"}
    assert f"<result>{calc('4*3+5')}</result>" in solved and solved.endswith("<answer>17</answer>")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="ops=5"):
        get_task("arithmetic", ops=5)
    with pytest.raises(ValueError, match="num_eval=2000"):
        get_task("arithmetic", num_eval=2000)
