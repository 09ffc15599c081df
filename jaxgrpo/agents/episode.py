"""The host-side record of one episode: the model's turns, the calls it made, what came back.

The rollout (which owns the token ids and the loss mask) appends one ``Turn`` per model turn:
the turn's text, the calls parsed from it and the results returned to the model. From the
record come the model's own text (``Episode.model_text``, the one text every answer and format
reward and every accuracy figure grades, so neither a tool's output nor a call's arguments can
supply the answer), the conversation in TRL's conversational form (``Episode.to_messages``),
which reward functions written for TRL's tool-calling ``GRPOTrainer`` read, and the step's
agent metrics (``metrics``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from jaxgrpo.agents.formats import ToolCall
from jaxgrpo.agents.tools import ERROR_KINDS, ToolResult


@dataclasses.dataclass
class Turn:
    """One model turn and the calls it made.

    Attributes:
      text: the model's text for the turn (decoded, without the end-of-turn token).
      calls: the calls parsed from ``text``, malformed ones included, in order.
      results: one per call, in the same order: what the model read back.
      truncated: how many of ``results`` the rollout cut to ``max_tool_tokens``.
      not_run: calls the turn wrote that were never run (the episode ended first: its turn
        limit or token budget); they are in ``text`` only.
    """

    text: str
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    results: list[ToolResult] = dataclasses.field(default_factory=list)
    truncated: int = 0
    not_run: int = 0

    def __post_init__(self):
        if len(self.calls) != len(self.results):
            raise ValueError(f"{len(self.calls)} calls but {len(self.results)} results")

    @property
    def content(self) -> str:
        """The turn's text without the calls that were read (they are actions, not what the
        model says), stripped: its assistant message's ``content`` (``Episode.to_messages``).
        A malformed call stays in the text."""
        content = self.text
        for call in self.calls:
            if call.error is None:
                content = content.replace(call.raw, "", 1)
        return content.strip()


@dataclasses.dataclass
class Episode:
    """The turns of one rollout, in order; the last has no calls unless the episode was cut
    short (``max_tool_calling_iterations``, the length limit)."""

    turns: list[Turn] = dataclasses.field(default_factory=list)

    def add_turn(
        self,
        text: str,
        calls: Sequence[ToolCall] = (),
        results: Sequence[ToolResult] = (),
        truncated: int = 0,
        not_run: int = 0,
    ) -> Turn:
        turn = Turn(text, list(calls), list(results), truncated, not_run)
        self.turns.append(turn)
        return turn

    @property
    def model_text(self) -> str:
        """What the model said: its turns' ``content`` (the assistant messages' contents of
        ``to_messages``), one per line.

        Graders read this, never the whole episode: it is text of the ids with model mask 1
        only, less the calls it made. A result is text a tool printed, and a call's arguments
        are the tool's input: with either graded, ``print("<answer>18</answer>")`` would pass
        for the model's answer.
        """
        return "\n".join(turn.content for turn in self.turns if turn.content)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def tool_calls(self) -> int:
        """Calls made, malformed ones included."""
        return sum(len(t.calls) for t in self.turns)

    @property
    def truncated_results(self) -> int:
        return sum(t.truncated for t in self.turns)

    @property
    def failures(self) -> collections.Counter[str]:
        """Failed calls by error kind (``tools.ERROR_KINDS``)."""
        return collections.Counter(r.error for t in self.turns for r in t.results if r.error)

    def to_messages(self, prompt_messages: Sequence[Mapping]) -> list[dict]:
        """The conversation in TRL's conversational form: the prompt's messages, then per turn
        an assistant message (with ``tool_calls`` when it made calls) and one ``tool`` message
        per call.

        An assistant message's ``content`` is the turn's text without the calls that were read
        (they are in ``tool_calls`` as ``{"type": "function", "function": {"name",
        "arguments"}}``); a malformed call stays in the text, and its error message is still
        answered by a ``tool`` message, so every result keeps its place.
        """
        messages = [dict(m) for m in prompt_messages]
        for turn in self.turns:
            read = [c for c in turn.calls if c.error is None]
            message: dict = {"role": "assistant", "content": turn.content}
            if read:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in read
                ]
            messages.append(message)
            for call, result in zip(turn.calls, turn.results, strict=True):
                messages.append({"role": "tool", "name": call.name or "", "content": result.text})
        return messages


def with_observation(prompt_messages: Sequence[Mapping], text: str | None) -> list[dict]:
    """The prompt with ``text`` (what an environment's ``reset`` returned) appended to the
    content of its last user message; unchanged for None."""
    messages = [dict(m) for m in prompt_messages]
    if text is None:
        return messages
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        raise ValueError("the prompt has no user message to append the environment's text to")
    messages[last_user]["content"] = f"{messages[last_user].get('content') or ''}{text}"
    return messages


def turn_records(episode: Episode) -> list[dict]:
    """An episode as JSON-able turns (``samples.jsonl``, evaluation records): the model's text,
    its calls and what each returned."""
    turns = []
    for turn in episode.turns:
        calls = [
            {"name": c.name, "arguments": c.arguments, "result": res.text, "error": res.error}
            for c, res in zip(turn.calls, turn.results, strict=True)
        ]
        turns.append({"text": turn.text, "calls": calls, "truncated_results": turn.truncated})
    return turns


def metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's agent metrics, means over ``episodes``.

    - ``agent/tool_calls``, ``agent/turns``, ``agent/truncated_results``: per episode;
    - ``agent/episodes_with_call``: the share of episodes that made a call;
    - ``agent/calls_not_run``: calls per episode that were not run (``Turn.not_run``);
    - ``agent/failed``: failed calls per episode; ``agent/failed/<kind>`` by error kind;
    - ``agent/failed_frac``: failed calls over all calls (0 without calls).
    """
    if not episodes:
        return {}
    n = len(episodes)
    failures = collections.Counter()
    for episode in episodes:
        failures.update(episode.failures)
    calls = sum(e.tool_calls for e in episodes)
    failed = sum(failures.values())
    out = {
        "agent/tool_calls": calls / n,
        "agent/turns": sum(e.num_turns for e in episodes) / n,
        "agent/episodes_with_call": sum(e.tool_calls > 0 for e in episodes) / n,
        "agent/calls_not_run": sum(t.not_run for e in episodes for t in e.turns) / n,
        "agent/truncated_results": sum(e.truncated_results for e in episodes) / n,
        "agent/failed": failed / n,
        "agent/failed_frac": failed / calls if calls else 0.0,
    }
    out.update({f"agent/failed/{kind}": failures[kind] / n for kind in ERROR_KINDS})
    return out
