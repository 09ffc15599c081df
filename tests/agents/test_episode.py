"""``agents.episode``: an episode's record gives TRL's conversational form and the step's
``agent/...`` means."""

from __future__ import annotations

import pytest

from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.episode import Episode, Turn, metrics, with_observation
from jaxgrpo.agents.formats import JsonFormat
from jaxgrpo.agents.tools import ERROR_KINDS, Toolbox, ToolResult

PROMPT = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "3*4+5?"}]


def _episode() -> Episode:
    """Turn 1: a good call and a malformed one; turn 2: an unknown tool; turn 3: the answer."""
    box, fmt = Toolbox([calc]), JsonFormat()
    episode = Episode()
    first = (
        'I will compute.<tool_call>{"name": "calc", "arguments": {"expression": "3*4+5"}}'
        '</tool_call><tool_call>{"name": </tool_call>'
    )
    second = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    for text, truncated in ((first, 1), (second, 0)):
        calls = fmt.parse(text)
        episode.add_turn(text, calls, [box.run(c, 1.0) for c in calls], truncated)
    episode.add_turn("The answer is 17.")
    return episode


def test_the_counts_of_one_episode():
    episode = _episode()
    assert (episode.num_turns, episode.tool_calls, episode.truncated_results) == (3, 3, 1)
    assert episode.failures == {"malformed_call": 1, "unknown_tool": 1}


def test_to_messages_is_trls_conversational_form():
    messages = _episode().to_messages(PROMPT)
    assert messages[:2] == PROMPT
    assert messages[2] == {
        "role": "assistant",
        "content": 'I will compute.<tool_call>{"name": </tool_call>',
        "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expression": "3*4+5"}}}
        ],
    }
    assert messages[3] == {"role": "tool", "name": "calc", "content": "17"}
    assert messages[4]["role"] == "tool" and messages[4]["content"].startswith(
        "{'error': 'could not read"
    )
    assert (
        messages[5]["content"] == ""
        and messages[5]["tool_calls"][0]["function"]["name"] == "search"
    )
    assert messages[6] == {
        "role": "tool",
        "name": "search",
        "content": "{'error': 'Tool search not found.'}",
    }
    assert messages[7] == {"role": "assistant", "content": "The answer is 17."}
    assert len(messages) == 8


def test_metrics_are_means_over_episodes():
    quiet = Episode()
    quiet.add_turn("17")
    out = metrics([_episode(), quiet])
    assert out["agent/tool_calls"] == 1.5 and out["agent/turns"] == 2.0
    assert out["agent/truncated_results"] == 0.5 and out["agent/failed"] == 1.0
    assert out["agent/failed_frac"] == pytest.approx(2 / 3)
    assert out["agent/failed/malformed_call"] == 0.5 and out["agent/failed/timeout"] == 0.0
    assert {f"agent/failed/{k}" for k in ERROR_KINDS} <= set(out)
    assert metrics([]) == {}


def test_a_turn_needs_one_result_per_call():
    with pytest.raises(ValueError, match="1 calls but 0 results"):
        Turn("x", JsonFormat().parse('<tool_call>{"name": "a"}</tool_call>'), [])
    assert Turn("x", [], []).results == [] and ToolResult("a").error is None


def test_resets_text_is_appended_to_the_last_user_message():
    messages = with_observation(PROMPT, " Start at 3.")
    assert messages[1]["content"] == "3*4+5? Start at 3." and PROMPT[1]["content"] == "3*4+5?"
    assert with_observation(PROMPT, None) == PROMPT
    with pytest.raises(ValueError, match="no user message"):
        with_observation([{"role": "system", "content": "x"}], "y")
