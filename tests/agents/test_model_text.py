"""What the model said, apart from its calls and what its tools returned: ``Episode.model_text``
is the one text every shipped answer and format reward and every accuracy figure grades, so a
``print("<answer>18</answer>")`` call cannot supply the graded answer; user reward functions
still get the whole episode as ``completions`` (TRL's), with ``model_completions`` beside it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxgrpo.agents.episode import Episode
from jaxgrpo.agents.formats import ToolCall
from jaxgrpo.agents.tools import ToolResult
from jaxgrpo.eval import metrics as eval_metrics
from jaxgrpo.grading import accuracy
from jaxgrpo.rewards import RewardSet, reward_inputs
from jaxgrpo.rewards.inputs import model_texts
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl import step_metrics

PROMPT = [{"role": "user", "content": "Tom has 3 boxes of 6 pens. How many pens?"}]
EXAMPLE = {"messages": PROMPT, "answer": "18", "reference": "3 * 6 = 18"}
CHEAT = 'print("<answer>18</answer>")'


def _episode(final: str) -> tuple[Episode, str]:
    """A python-tool episode whose tool printed ``<answer>18</answer>``, then a last turn
    ``final``; and the whole episode's text as the rollout decodes it (results included)."""
    raw = f'<tool_call>{{"name": "python", "arguments": {{"code": {CHEAT!r}}}}}</tool_call>'
    call = ToolCall(name="python", arguments={"code": CHEAT}, raw=raw)
    episode = Episode()
    episode.add_turn(raw, [call], [ToolResult("<answer>18</answer>")])
    episode.add_turn(final)
    whole = f"{raw}<tool_response>\n<answer>18</answer>\n</tool_response>{final}"
    return episode, whole


@pytest.fixture
def batch():
    """Two episodes of one example: the tool printed the answer in both; only the second's
    model wrote it itself."""
    cheat, cheat_text = _episode("Done.")
    honest, honest_text = _episode("So <answer>18</answer>")
    return [cheat, honest], [cheat_text, honest_text]


def test_model_text_is_the_turns_without_the_results(batch):
    (cheat, honest), (cheat_text, _) = batch
    assert "<answer>18</answer>" in cheat_text
    assert "<answer>18</answer>" not in cheat.model_text, "neither the call nor its result"
    assert cheat.model_text == "Done."
    messages = cheat.to_messages(PROMPT)
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["", "Done."]
    assert honest.model_text == "So <answer>18</answer>"
    assert model_texts(["a", "b"], None) == ["a", "b"], "without tools: the completion itself"


def test_tool_output_scores_nothing_on_the_answer_and_format_rewards(batch):
    episodes, texts = batch
    inputs = reward_inputs([EXAMPLE], 2, ["p"] * 2, texts, [[1, 2]] * 2, episodes=episodes)
    names = ["exact_answer", "format", "format_r1", "format_copy", "hard_soft"]
    seen = {}

    def spy(prompts, completions, model_completions, **kwargs):
        seen["completions"], seen["model"] = completions, model_completions
        return [0.0] * len(completions)

    specs = [(n, 1.0) for n in names[:4]]
    specs += [("hard_soft", 1.0, {"embedding_fn": lambda *a, **k: [0.0] * len(a[1])}), (spy, 0)]
    _, per_fn, _ = RewardSet(specs).score(inputs)
    assert per_fn["exact_answer"].tolist() == [0.0, 1.0]
    assert per_fn["hard_soft"].tolist() == [0.0, 0.5]
    for name in ("format", "format_r1", "format_copy"):
        assert per_fn[name][0] < per_fn[name][1], name
        assert per_fn[name][0] <= 0.0, f"{name}: no answer tag of the model's own"
    assert seen["completions"] == texts, "a user function gets the whole episode, as in TRL"
    assert seen["model"] == [e.model_text for e in episodes]


def test_strict_lenient_format_and_pass_at_k_grade_only_the_model_text(batch):
    episodes, texts = batch
    sampled = {"tokens": np.ones((2, 4), np.int32), "mask": np.ones((2, 4), np.int32)}
    sampled["model_mask"] = np.array([[1, 0, 0, 1], [1, 0, 1, 1]], np.int32)
    _, _, _, correct = ro.score(
        RewardSet([("format", 1.0)]), "gsm8k", [EXAMPLE], ["p"] * 2, texts, 2, 0,
        sampled=sampled, episodes=episodes,
    )  # fmt: skip
    assert correct.tolist() == [False, True]
    columns = {"answer": ["18", "18"]}
    assert accuracy.rates(model_texts(texts, episodes), columns) == {
        accuracy.STRICT: 0.5,
        accuracy.LENIENT: 0.5,
        accuracy.FORMAT: 0.5,
    }
    assert accuracy.rates(texts, columns)[accuracy.STRICT] == 1.0, "the whole text would cheat"
    records = eval_metrics.score_samples(
        texts, ["18"], 2, model_completions=model_texts(texts, episodes), model_tokens=[2, 3]
    )
    assert [r["strict"] for r in records] == [False, True]
    assert [r["answer"] for r in records] == [None, "18"]
    assert records[0]["completion"] == texts[0], "the record shows the whole episode"
    summary = eval_metrics.summarize(records, 2)
    assert summary["pass@1"] == 0.5 and summary["strict_accuracy"] == 0.5
    assert summary["length"]["mean"] == 2.5, "the model's ids"
    assert "tool_length" in summary


def test_held_out_metrics_grade_the_model_text_and_count_its_tokens(batch):
    episodes, texts = batch
    examples = [EXAMPLE, EXAMPLE]
    model_mask = [[1, 0, 0, 1], [1, 1, 0, 1]]
    inputs = reward_inputs(
        examples, 1, ["p"] * 2, texts, [[5] * 4] * 2, episodes=episodes, model_mask=model_mask
    )
    m = step_metrics.eval_metrics(RewardSet([("exact_answer", 1.0)]), inputs, [False, False])
    assert m["strict_accuracy"] == 0.5 and m["reward/exact_answer/mean"] == 0.5
    assert m["length_mean"] == 2.5 and m["tool_length_mean"] == 1.5


def test_single_turn_runs_grade_the_completion_as_before():
    texts = ["<answer>18</answer>", "17"]
    inputs = reward_inputs([EXAMPLE], 2, ["p"] * 2, texts, [[1], [2, 3]])
    assert inputs.model_completions == texts and inputs.lengths == [1, 2]
    _, per_fn, _ = RewardSet([("exact_answer", 1.0)]).score(inputs)
    assert per_fn["exact_answer"].tolist() == [1.0, 0.0]
