"""What one reward call gets: ``RewardInputs``, built by ``reward_inputs`` for every caller.

Training steps, held-out evaluation during training, ``python -m jaxgrpo.evaluate`` and studies
all build their reward calls here, so a reward function (a TRL one included) gets the same
keyword arguments wherever it runs: the prompts and completions, ``completion_ids`` and
``completion_lengths``, the task's columns, the step and the run's length for
``trainer_state``, and the examples' chats for TRL's conversational form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def columns_for(examples: Sequence[dict], group_size: int) -> dict[str, list[Any]]:
    """The task's columns (every key but ``messages``), each repeated for the G samples."""
    keys = [k for k in examples[0] if k != "messages"] if examples else []
    return {k: [ex.get(k) for ex in examples for _ in range(group_size)] for k in keys}


@dataclasses.dataclass(frozen=True)
class RewardInputs:
    """One batch of completions to score, G per example, grouped by example.

    Attributes:
      prompts: [N] prompts as the model saw them (the chat template applied).
      completions: [N] decoded completions.
      columns: per-sample keyword arguments, each of length N: the task's columns (e.g.
        ``answer``), ``completion_ids`` (the sampled ids, no padding, up to and including the
        stop token) and ``completion_lengths`` (their lengths).
      prompt_messages: [N] the examples' chats, TRL's conversational ``prompts``.
      completion_messages: [N] each episode's messages after the prompt (assistant turns with
        ``tool_calls``, then ``tool`` messages), TRL's conversational ``completions`` of a
        tool-calling run; None: one assistant message holding the completion.
      step: the training step the completions belong to (curricula, ``trainer_state``).
      max_steps: the run's ``steps`` (``trainer_state.max_steps``; 0 when unknown).
    """

    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]]
    prompt_messages: list[list[dict]]
    step: int = 0
    max_steps: int = 0
    completion_messages: list[list[dict]] | None = None


def reward_inputs(
    examples: Sequence[dict],
    group_size: int,
    prompts: Sequence[str],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    *,
    step: int = 0,
    max_steps: int = 0,
    episodes: Sequence[Any] | None = None,
    environments: Sequence[Any] | None = None,
    prompt_messages: Sequence[list[dict]] | None = None,
) -> RewardInputs:
    """The ``RewardInputs`` of ``group_size`` completions per example.

    Args:
      examples: [B] task examples (``messages`` plus the task's columns).
      group_size: G, completions per example.
      prompts: [B * G] rendered prompts, one per completion.
      completions: [B * G] completion texts.
      completion_ids: [B * G] the sampled token ids of each completion, without padding.
      step / max_steps: see ``RewardInputs``.
      episodes: [B * G] ``jaxgrpo.agents.Episode`` records of a tool-calling run: the
        ``episodes`` column, and the conversational completions (``Episode.to_messages``).
      environments: [B * G] the episodes' environment instances: the ``environments`` column
        (TRL's), which reward functions read the episode's state from.
      prompt_messages: [B * G] the chats the episodes started from (the tools' instructions
        and the environments' text added); default: the examples'.
    """
    n = len(examples) * group_size
    for name, values in (("prompts", prompts), ("completions", completions)):
        if len(values) != n:
            raise ValueError(f"{len(values)} {name} for {len(examples)} examples x {group_size}")
    if len(completion_ids) != n:
        raise ValueError(f"{len(completion_ids)} completion_ids for {n} completions")
    ids = [[int(t) for t in row] for row in completion_ids]
    columns = columns_for(examples, group_size)
    columns["completion_ids"] = ids
    columns["completion_lengths"] = [len(row) for row in ids]
    if prompt_messages is None:
        prompt_messages = [ex["messages"] for ex in examples for _ in range(group_size)]
    messages = [list(m) for m in prompt_messages]
    completion_messages = None
    if episodes is not None:
        columns["episodes"] = list(episodes)
        completion_messages = [
            e.to_messages(m)[len(m) :] for e, m in zip(episodes, messages, strict=True)
        ]
    if environments is not None:
        columns["environments"] = list(environments)
    return RewardInputs(
        list(prompts), list(completions), columns, messages, step, max_steps, completion_messages
    )
