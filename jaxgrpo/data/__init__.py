"""Tasks: prompts plus the columns their rewards need, from synthetic, hub or local data.

``get_task(name, **kwargs)`` builds a task by registry name; kwargs are the task dataclass's
fields (e.g. ``source="data/train.jsonl"``, ``template="r1"``). Every task has ``name``,
``columns``, ``default_rewards``, ``train_examples(seed)`` and ``eval_examples()``; examples are
dicts ``{"messages": [...], <columns>}`` (see ``jaxgrpo.data.base``).
"""

from __future__ import annotations

import dataclasses

from jaxgrpo.data.arithmetic import ArithmeticTask
from jaxgrpo.data.base import (
    ANSWER_TAG_INSTRUCTION,
    R1_SYSTEM_PROMPT,
    TEMPLATES,
    MalformedRowError,
    Task,
    build_messages,
    prompt_key,
)
from jaxgrpo.data.code import CodeTask
from jaxgrpo.data.format_copy import FormatCopyTask
from jaxgrpo.data.gsm8k import GSM8KTask, GSM8KTracesTask
from jaxgrpo.data.jeebench import JEEBenchTask
from jaxgrpo.data.jsonl import JsonlTask
from jaxgrpo.data.math import MathTask
from jaxgrpo.data.sonnets import SonnetsTask

TASKS: dict[str, type] = {
    cls.name: cls
    for cls in (
        FormatCopyTask,
        ArithmeticTask,
        GSM8KTask,
        GSM8KTracesTask,
        MathTask,
        JEEBenchTask,
        SonnetsTask,
        CodeTask,
        JsonlTask,
    )
}


_ALIASES = {"prompt_template": "template"}
_EMPTY_MEANS_DEFAULT = ("template", "system_prompt")


def get_task(name: str, **kwargs) -> Task:
    """Builds the task registered as ``name``.

    ``prompt_template`` is accepted as an alias of ``template`` (the config's field name), and an
    empty string for ``template`` or ``system_prompt`` means "the task's default", so a config
    can pass its fields through unconditionally.

    Raises:
      ValueError: unknown task name, or a keyword the task does not accept (the message lists
        the accepted ones).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
    kwargs = {k: v for k, v in kwargs.items() if not (k in _EMPTY_MEANS_DEFAULT and v == "")}
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(
            f"task {name!r} got unknown option(s) {unknown}; accepted: {sorted(fields)}"
        )
    return cls(**kwargs)


__all__ = [
    "ANSWER_TAG_INSTRUCTION",
    "R1_SYSTEM_PROMPT",
    "TASKS",
    "TEMPLATES",
    "MalformedRowError",
    "Task",
    "build_messages",
    "get_task",
    "prompt_key",
]
