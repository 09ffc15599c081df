"""Reward functions: the package's own, the registry configs refer to them by (``registry``),
user functions by dotted path, and ``RewardSet`` (``combine``), which calls them.

Configs say ``rewards = [("exact_answer", 1.0), ("format", 0.2)]``; see ``combine.RewardSet``.

Signature: TRL's. ``RewardSet`` calls every function as GRPOTrainer's ``_calculate_rewards``
does, all by keyword, and takes back ``list[float | None]`` of length N (``None``: cannot
score; excluded from group statistics)::

    fn(prompts=..., completions=..., completion_ids=..., completion_lengths=...,
       model_completions=..., trainer_state=..., log_extra=..., log_metric=..., **columns)

- ``prompts``, ``completions``: [N], one per sampled completion (G per prompt, grouped), as
  TRL gives them for the same data. ``rewards.conversational="auto"`` (the default) follows
  TRL's rule: where the data's rows are chats (a ``prompt``/``messages`` column of messages,
  ``jaxgrpo.data.base.CHAT_ROW``) each prompt is the chat (a list of ``{"role", "content"}``
  dicts) and each completion ``[{"role": "assistant", "content": text}]`` (with tools, the
  episode's assistant turns with ``tool_calls`` and its ``tool`` messages); where the task
  built the prompt from text columns, strings: the prompt rendered through the chat template,
  as the model saw it, and the decoded completion (with tools, the whole episode, results
  included). True or False forces one form.
- ``model_completions``: [N] strings, what the model wrote alone: with tools, the episode's
  turns without the tools' results (``jaxgrpo.agents.Episode.model_text``); without tools, the
  completion. jaxgrpo's own functions (anything in this package) get these as their
  ``completions`` (strings, always), so no shipped reward and no accuracy figure grades a
  tool's output; they also accept TRL's conversational completions when called directly.
- ``completion_ids``: [N] lists of sampled token ids, without padding, up to and including
  the stop token (TRL's masked ``completion_ids``); ``completion_lengths``: [N] ints, their
  lengths (jaxgrpo's own ``length_penalty`` reads them).
- ``trainer_state``: a ``combine.TrainerState`` with ``global_step`` (the step being scored,
  0-based) and ``max_steps`` (the run's ``steps``), the fields of ``transformers.TrainerState``
  that reward functions use; no others.
- ``log_extra(column, values)`` and ``log_metric(name, value)``: accepted as in TRL; what they
  receive is kept on ``RewardSet.logged_extra`` / ``logged_metrics`` for the latest step.
- ``**columns``: every task column but ``messages`` (e.g. ``answer``, ``reference``), one
  value per completion. Functions must therefore accept ``**kwargs``, as TRL's must.

Every caller (training steps, held-out evaluation during training, ``python -m
jaxgrpo.evaluate``, studies) builds these arguments with ``inputs.reward_inputs`` and calls
``RewardSet.score``, so a function gets the same arguments wherever it runs; outside training
``trainer_state.global_step`` is the step of the evaluated parameters.

So a function written for TRL's GRPOTrainer runs unchanged, ``async def`` ones included: they
are awaited, a step's together (``calls``). Each call is bounded (``limits``): past
``rewards.timeout_s`` seconds, or once it has grown the process by ``rewards.max_memory_gb``,
it is interrupted and its samples score None, counted in ``reward/<fn>/failed_frac``. A
function that raises or returns None for every sample of ``rewards.max_failed_steps``
consecutive steps stops the run with a ``RewardError`` naming it and a failing sample.

Model-based rewards (``embedding``, ``perplexity``) import the model code and load their
weights on first call, so importing this package loads no model. A name that is a checkpoint
directory or hub id is a reward model (``reward_model``, TRL's ``reward_funcs=<model id>``),
which the run builder loads on the run's mesh; it is called as a user's function is, with
TRL's prompts and completions.
"""

from __future__ import annotations

from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.code import code_tests
from jaxgrpo.rewards.combine import Curriculum, RewardError, RewardSet, TrainerState
from jaxgrpo.rewards.format import format_copy, format_r1, format_strict
from jaxgrpo.rewards.hybrid import embedding_bleu, hard_soft
from jaxgrpo.rewards.inputs import RewardInputs, columns_for, reward_inputs
from jaxgrpo.rewards.length import length_penalty, repetition_penalty
from jaxgrpo.rewards.math import exact_answer
from jaxgrpo.rewards.registry import REWARDS, get_reward, reward_name
from jaxgrpo.rewards.sonnet import sonnet_form, sonnet_lines, sonnet_meter, sonnet_rhyme

__all__ = [
    "REWARDS",
    "Curriculum",
    "RewardError",
    "RewardInputs",
    "RewardSet",
    "TrainerState",
    "bleu",
    "code_tests",
    "columns_for",
    "embedding_bleu",
    "exact_answer",
    "format_copy",
    "format_r1",
    "format_strict",
    "get_reward",
    "hard_soft",
    "length_penalty",
    "repetition_penalty",
    "reward_inputs",
    "reward_name",
    "sonnet_form",
    "sonnet_lines",
    "sonnet_meter",
    "sonnet_rhyme",
]
