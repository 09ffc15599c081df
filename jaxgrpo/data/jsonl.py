"""jsonl: a user's own data files (jsonl, json or parquet) mapped to examples by column names.

``prompt_column`` becomes ``messages``: a string is wrapped by the prompt template (default
``"none"``: the text is the user turn); a list of ``{"role", "content"}`` dicts is used as the
conversation as is, and the example is marked ``CHAT_ROW`` (its rewards get TRL's
conversational form under ``rewards.conversational="auto"``). Other columns are passed through
to the rewards, either all of them (``column_map=None``) or only those named in ``column_map``
(example name -> file column), e.g. ``{"answer": "label", "reference": "solution"}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxgrpo.data.base import CHAT_ROW, Example, Message, Row, RowTask, require_str

_ROLES = ("system", "user", "assistant")


def _as_messages(row: Row, value: Any, field: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise row.fail(f"field {field!r} must be a string or a non-empty list of messages")
    for i, m in enumerate(value):
        ok = isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
        if not ok:
            raise row.fail(f"field {field!r}: message {i} needs a role in {_ROLES} and content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


@dataclasses.dataclass
class JsonlTask(RowTask):
    """Examples from a user's file.

    Attributes:
      prompt_column: column holding the prompt (string or list of chat messages).
      column_map: example column -> file column to pass through; None passes every other column
        under its own name.
      reward_names: default rewards as ``(name, weight)`` pairs for configs that name none.
    """

    eval_split: str | None = None
    template: str = "none"
    prompt_column: str = "prompt"
    column_map: dict[str, str] | None = None
    reward_names: tuple[tuple[str, float], ...] = ()

    name: ClassVar[str] = "jsonl"

    @property
    def columns(self) -> tuple[str, ...]:
        """Columns named by ``column_map`` (unknown until rows are read when it is None)."""
        return tuple(self.column_map or ())

    @property
    def default_rewards(self) -> tuple[tuple[str, float], ...]:
        return tuple(self.reward_names)

    def to_example(self, row: Row) -> Example:
        value = row.get(self.prompt_column)
        if isinstance(value, str):
            messages = self.messages(require_str(row, value, self.prompt_column))
        else:
            messages = _as_messages(row, value, self.prompt_column)
            if self.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if self.column_map is None:
            extra = {k: v for k, v in row.data.items() if k != self.prompt_column}
        else:
            extra = {name: row.get(column) for name, column in self.column_map.items()}
        for reserved in ("messages", CHAT_ROW):
            if reserved in extra:
                raise row.fail(
                    f"a passed-through column is named {reserved!r}; rename it in column_map"
                )
        example = {"messages": messages, **extra}
        if not isinstance(value, str):
            example[CHAT_ROW] = True
        return example
