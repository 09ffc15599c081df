"""format_copy's train-only worked-example curriculum (``train_example_prob`` / ``_decay``)."""

import pytest

from jaxgrpo import data


def _shown(example) -> bool:
    """True when the prompt carries the worked user/assistant exchange."""
    return any(m["role"] == "assistant" for m in example["messages"])


def test_curriculum_never_reaches_eval_prompts():
    task = data.get_task("format_copy", worked_example=False, train_example_prob=1.0)
    assert all(_shown(e) for e in task.train_examples(0))  # p = 1 everywhere, no decay
    evals = task.eval_examples()
    assert len(evals) == 64 and not any(_shown(e) for e in evals)
    assert evals == data.get_task("format_copy", worked_example=False).eval_examples()


def test_curriculum_keeps_the_integers_and_the_plain_prompt_shape():
    kw = dict(num_train=256, worked_example=False)
    plain = data.get_task("format_copy", **kw).train_examples(3)
    mixed = data.get_task("format_copy", train_example_prob=0.5, **kw).train_examples(3)
    assert [e["answer"] for e in plain] == [e["answer"] for e in mixed]
    assert not any(_shown(e) for e in plain)
    for p, m in zip(plain, mixed, strict=True):
        # Same system and final user turn; the example, when shown, sits between them.
        assert m["messages"][0] == p["messages"][0] and m["messages"][-1] == p["messages"][-1]
        assert len(m["messages"]) == (4 if _shown(m) else 2)


def test_curriculum_decays_linearly_to_zero():
    """p_i = 1 - i/100 for i < 100, then 0. Shown count over the first 100 is a sum of
    Bernoullis with mean 50.5 and std ~4.1, so [30, 71] is a > 4.9 sigma band."""
    task = data.get_task(
        "format_copy",
        num_train=512,
        worked_example=False,
        train_example_prob=1.0,
        train_example_decay=100,
    )
    probs = task.example_probs(512)
    assert probs[0] == 1.0 and probs[50] == pytest.approx(0.5) and (probs[100:] == 0).all()
    train = task.train_examples(0)
    shown = [_shown(e) for e in train]
    assert shown[0] and not any(shown[100:])
    assert 30 <= sum(shown[:100]) <= 71, sum(shown[:100])
    assert sum(shown[:50]) > sum(shown[50:100])  # mean 37.75 vs 12.75
    assert train == task.train_examples(0)  # deterministic by seed
    assert train != task.train_examples(1)


def test_worked_example_flag_still_puts_it_everywhere():
    task = data.get_task("format_copy", num_train=16, worked_example=True)
    assert all(_shown(e) for e in task.train_examples(0) + task.eval_examples())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"train_example_prob": 1.5}, "train_example_prob"),
        ({"train_example_prob": -0.1}, "train_example_prob"),
        ({"train_example_decay": -1}, "train_example_decay"),
    ],
)
def test_curriculum_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.get_task("format_copy", **kwargs)
