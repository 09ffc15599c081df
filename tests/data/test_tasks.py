"""Tasks: registry, prompt templates, format_copy, and every bundled fixture through its task."""

import pytest

from jaxgrpo import data
from jaxgrpo.data.base import ANSWER_TAG_INSTRUCTION, R1_SYSTEM_PROMPT, prompt_key
from jaxgrpo.rewards import REWARDS

FIXTURE_TASKS = ["gsm8k", "gsm8k_r1_traces", "math", "sonnets", "code"]


def _check_messages(example):
    messages = example["messages"]
    assert messages and messages[-1]["role"] == "user", messages
    for m in messages:
        assert set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
        assert isinstance(m["content"], str) and m["content"].strip()


def test_get_task_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*gsm8k"):
        data.get_task("gsm9k")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tempalte'\]"):
        data.get_task("gsm8k", tempalte="r1")


def test_config_style_kwargs_empty_means_default_and_alias():
    task = data.get_task("gsm8k", source="fixture", prompt_template="", system_prompt="")
    assert task.template == "answer_tag" and task.system_prompt is None
    task = data.get_task("gsm8k", source="fixture", prompt_template="r1")
    assert task.template == "r1"


def test_default_rewards_are_registered():
    for name, cls in data.TASKS.items():
        task = cls()
        for reward, weight in task.default_rewards:
            assert reward in REWARDS, f"task {name} defaults to unknown reward {reward!r}"
            assert weight > 0


@pytest.mark.parametrize(
    "template, system, check",
    [
        ("answer_tag", None, lambda m: m[-1]["content"].startswith(ANSWER_TAG_INSTRUCTION)),
        ("r1", None, lambda m: m[0] == {"role": "system", "content": R1_SYSTEM_PROMPT}),
        ("r1", "Be brief.", lambda m: m[0]["content"] == "Be brief." and len(m) == 2),
        ("none", "Sys.", lambda m: m[1]["content"] == "What is 2+2?" and m[0]["role"] == "system"),
        (
            "Q: {question}\nA:",
            None,
            lambda m: m == [{"role": "user", "content": "Q: What is 2+2?\nA:"}],
        ),
    ],
)
def test_prompt_templates(template, system, check):
    messages = data.build_messages("What is 2+2?", template=template, system_prompt=system)
    assert check(messages), messages
    assert "What is 2+2?" in messages[-1]["content"]


def test_unknown_template_fails_with_choices():
    with pytest.raises(ValueError, match="answer_tag"):
        data.build_messages("q", template="r2")


def test_format_copy_is_deterministic_and_disjoint():
    task = data.get_task("format_copy", num_train=512)
    a, b, c = task.train_examples(0), task.train_examples(0), task.train_examples(1)
    assert a == b and a != c and len(a) == 512
    evals = task.eval_examples()
    assert len(evals) == 64 and len({e["answer"] for e in evals}) == 64
    assert evals == data.get_task("format_copy", num_train=8).eval_examples()  # Fixed set.
    eval_keys = {prompt_key(e) for e in evals}
    for seed in range(4):
        train = task.train_examples(seed)
        assert not eval_keys & {prompt_key(e) for e in train}, f"seed {seed} leaks eval prompts"
    for e in a[:20] + evals[:5]:
        _check_messages(e)
        assert e["messages"][-1]["content"] == f"Copy this integer exactly: {e['answer']}"
        assert str(int(e["answer"])) == e["answer"]


def test_format_copy_worked_example_flag():
    on = data.get_task("format_copy").eval_examples()[0]["messages"]
    off = data.get_task("format_copy", worked_example=False).eval_examples()[0]["messages"]
    assert [m["role"] for m in on] == ["system", "user", "assistant", "user"]
    assert on[2]["content"].startswith("<answer>") and on[2]["content"].endswith("</answer>")
    assert [m["role"] for m in off] == ["system", "user"]
    assert "exactly one <answer></answer> tag" in on[0]["content"]
    with pytest.raises(ValueError, match="too small"):
        data.get_task("format_copy", low=0, high=100)


@pytest.mark.parametrize("name", FIXTURE_TASKS)
def test_fixture_tasks_load_with_columns_and_disjoint_splits(name):
    task = data.get_task(name, source="fixture")
    train, evals = task.train_examples(seed=3), task.eval_examples()
    assert len(train) >= 4 and len(evals) >= 1, (len(train), len(evals))
    for e in train + evals:
        _check_messages(e)
        assert set(task.columns) <= set(e), (task.columns, sorted(e))
    train_keys = {prompt_key(e) for e in train}
    assert not train_keys & {prompt_key(e) for e in evals}
    # Seeds permute the same training set; the eval set does not depend on the seed.
    other = task.train_examples(seed=4)
    assert sorted(map(prompt_key, other)) == sorted(train_keys) and other != train
    assert data.get_task(name, source="fixture", num_eval=1).eval_examples() == evals[:1]


def test_jeebench_fixture_is_eval_only():
    task = data.get_task("jeebench", source="fixture")
    evals = task.eval_examples()
    assert len(evals) == 5 and {e["type"] for e in evals} == {
        "MCQ",
        "MCQ(multiple)",
        "Integer",
        "Numeric",
    }
    for e in evals:
        _check_messages(e)
    mcq = next(e for e in evals if e["type"] == "MCQ(multiple)")
    assert mcq["answer"] == "AC" and "all their letters" in mcq["messages"][-1]["content"]
    with pytest.raises(ValueError, match="evaluation-only"):
        task.train_examples()
