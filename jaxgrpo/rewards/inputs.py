"""What one reward call gets: ``RewardInputs``, built by ``reward_inputs`` for every caller.

Training steps, held-out evaluation during training, ``python -m jaxgrpo.evaluate`` and studies
all build their reward calls here, so a reward function (a TRL one included) gets the same
keyword arguments wherever it runs: the prompts and completions, ``completion_ids`` and
``completion_lengths``, ``model_completions``, the task's columns, the step and the run's length
for ``trainer_state``, and the examples' chats for TRL's conversational form.

``completions`` are whole episodes, tools' results included (TRL's); ``model_completions`` is
what the model wrote alone (``model_texts``), the text every shipped answer and format reward
and every accuracy figure grades. Without tools the two are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxgrpo.data.base import CHAT_ROW

_NOT_COLUMNS = ("messages", CHAT_ROW)


def columns_for(examples: Sequence[dict], group_size: int) -> dict[str, list[Any]]:
    """The task's columns (every key but ``messages`` and the ``CHAT_ROW`` mark), each repeated
    for the G samples."""
    keys = [k for k in examples[0] if k not in _NOT_COLUMNS] if examples else []
    return {k: [ex.get(k) for ex in examples for _ in range(group_size)] for k in keys}


def rows_are_chats(examples: Sequence[dict]) -> bool:
    """TRL's ``is_conversational`` of the data: the (first) example's row held its prompt as
    chat messages (``jaxgrpo.data.base.CHAT_ROW``), not text the task built a chat from."""
    return bool(examples) and bool(examples[0].get(CHAT_ROW))


def model_texts(completions: Sequence[str], episodes: Sequence[Any] | None) -> list[str]:
    """[N] what the model wrote of each completion: the episode's ``model_text`` (its turns,
    without the tools' results) with tools, else the completion itself."""
    if episodes is None:
        return list(completions)
    if len(episodes) != len(completions):
        raise ValueError(f"{len(episodes)} episodes for {len(completions)} completions")
    return [e.model_text for e in episodes]


@dataclasses.dataclass(frozen=True)
class RewardInputs:
    """One batch of completions to score, G per example, grouped by example.

    Attributes:
      prompts: [N] prompts as the model saw them (the chat template applied).
      completions: [N] decoded completions: whole episodes, tools' results included.
      columns: per-sample keyword arguments, each of length N: the task's columns (e.g.
        ``answer``), ``completion_ids`` (the episode's ids, no padding, up to and including the
        stop token), ``completion_lengths`` (their lengths) and ``model_completions`` (what the
        model wrote alone, ``model_texts``).
      prompt_messages: [N] the examples' chats, TRL's conversational ``prompts``.
      completion_messages: [N] each episode's messages after the prompt (assistant turns with
        ``tool_calls``, then ``tool`` messages), TRL's conversational ``completions`` of a
        tool-calling run; None: one assistant message holding the completion.
      step: the training step the completions belong to (curricula, ``trainer_state``).
      max_steps: the run's ``steps`` (``trainer_state.max_steps``; 0 when unknown).
      conversational: the data's rows are chats (``rows_are_chats``): what
        ``rewards.conversational="auto"`` gives reward functions TRL's message lists for.
      model_lengths: [N] ids the model drew of each completion (tools' results not counted);
        None: ``completion_lengths``.
    """

    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]]
    prompt_messages: list[list[dict]]
    step: int = 0
    max_steps: int = 0
    completion_messages: list[list[dict]] | None = None
    conversational: bool = False
    model_lengths: list[int] | None = None

    @property
    def model_completions(self) -> list[str]:
        """[N] what the model wrote (the ``model_completions`` column; else ``completions``)."""
        return list(self.columns.get("model_completions", self.completions))

    @property
    def lengths(self) -> list[int]:
        """[N] the model's ids per completion: ``model_lengths``, else every id's count."""
        if self.model_lengths is not None:
            return list(self.model_lengths)
        return [len(row) for row in self.columns.get("completion_ids", [])]


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
    model_mask: Sequence[Sequence[int]] | None = None,
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
      model_mask: [B * G] per completion, 1 on each of ``completion_ids`` the model drew and 0
        on the tools' results (``RewardInputs.model_lengths``); None: every id is the model's.
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
    columns["model_completions"] = model_texts(completions, episodes)
    model_lengths = None
    if model_mask is not None:
        model_lengths = [int(sum(int(m) != 0 for m in row)) for row in model_mask]
        if len(model_lengths) != n:
            raise ValueError(f"{len(model_lengths)} model_mask rows for {n} completions")
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
        list(prompts),
        list(completions),
        columns,
        messages,
        step,
        max_steps,
        completion_messages,
        conversational=rows_are_chats(examples),
        model_lengths=model_lengths,
    )
