"""Sonnets: write a Shakespearean sonnet on a theme (a non-verifiable writing task).

Source: Lambent/shakespeare_sonnets_diffused (the seed study's sonnet data) or a local file. Its
schema is not documented, so the columns are configurable; by default we take

    theme      the first present of ``THEME_CANDIDATES``      (``theme_column``)
    reference  the first present of ``REFERENCE_CANDIDATES``  (``reference_column``), optional

The prompt follows the seed study: a "master poet" system turn and the user turn
"Write a sonnet about <theme>." Examples carry ``theme`` and ``reference`` (the reference sonnet,
or None when the row has none: reference-based rewards then score None, i.e. "cannot score").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, pick_column, require_str

SONNET_SYSTEM_PROMPT = (
    "You are a master poet. Write a Shakespearean sonnet: fourteen lines of iambic pentameter "
    "rhyming ABAB CDCD EFEF GG."
)
THEME_CANDIDATES = ("theme", "topic", "title", "prompt")
REFERENCE_CANDIDATES = ("sonnet", "poem", "text", "response", "completion", "output")


@dataclasses.dataclass
class SonnetsTask(RowTask):
    """Theme-conditioned sonnet writing.

    Attributes:
      theme_column: column holding the theme (None: first of ``THEME_CANDIDATES``).
      reference_column: column holding a reference sonnet (None: first of
        ``REFERENCE_CANDIDATES`` present, if any).
    """

    eval_split: str | None = None  # One train split on the hub; eval is split off by hash.
    template: str = "none"
    system_prompt: str | None = SONNET_SYSTEM_PROMPT
    theme_column: str | None = None
    reference_column: str | None = None

    name: ClassVar[str] = "sonnets"
    columns: ClassVar[tuple[str, ...]] = ("theme", "reference")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (("sonnet_form", 1.0),)
    fixture: ClassVar[str] = "sonnets.jsonl"
    hub_id: ClassVar[str] = "Lambent/shakespeare_sonnets_diffused"

    def to_example(self, row: Row) -> Example:
        theme = pick_column(row, self.theme_column, THEME_CANDIDATES, "the theme")
        theme = require_str(row, theme, self.theme_column or "theme").strip().rstrip(".")
        if self.reference_column is not None:
            reference = row.get(self.reference_column)
        else:
            present = [c for c in REFERENCE_CANDIDATES if row.data.get(c)]
            reference = row.data[present[0]] if present else None
        return {
            "messages": self.messages(f"Write a sonnet about {theme}."),
            "theme": theme,
            "reference": reference,
        }
