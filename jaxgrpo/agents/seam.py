"""Where a model's calling turn ends and the format's text begins (``Seam``).

A calling turn is cut at the id whose text completes one of the format's stop strings (the
sampler stops there; ``turn_end`` finds it again on the host, for samplers without stop
strings). The tokenizer may have merged the string's last characters with the next ones into
that id; ``Seam.join`` makes what follows the call exactly the format's text anyway, without
tokenizing a model id again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def turn_end(tokenizer: Any, ids: Sequence[int], stop_strings: Sequence[str]) -> int:
    """How many of a turn's ``ids`` to keep: up to the first id whose text completes one of
    ``stop_strings`` (the fewest ids whose decoded text contains it), else all of them."""
    if not stop_strings:
        return len(ids)

    def stops(k: int) -> bool:
        text = tokenizer.hf.decode(list(ids[:k]))
        return any(s in text for s in stop_strings)

    if not stops(len(ids)):
        return len(ids)
    lo, hi = 0, len(ids)  # stops(hi), not stops(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stops(mid) else (mid, hi)
    return hi


@dataclasses.dataclass(frozen=True)
class Seam:
    """Where a calling turn's model ids end and the format's text begins.

    A stop string can end inside the turn's last id (SmolLM2 writes ``</calc><result>`` as
    ``</`` ``calc`` ``><`` ``result`` ``>``: the id ``><`` completes ``</calc>`` and carries
    ``<``). That id's text past the stop string, the overhang, is read as the start of what
    follows: the appended ids hold the rest. Where the overhang is not the start of what
    follows, the id is dropped from the turn and the appended text starts with the part of the
    stop string it held. Either way the episode's text is the model's call followed by exactly
    the format's text, and no model id is tokenized again.

    Attributes:
      ids: the turn's ids up to the one that completes its stop string (all without one).
      text: the turn's text up to the end of its stop string (what the calls are read from).
      overhang: the last id's text past the stop string ("" when it ends there).
      prefix: the text of ``ids[:-1]`` (used when the last id is dropped).
      at_stop: a stop string ended the turn.
    """

    ids: list[int]
    text: str
    overhang: str = ""
    prefix: str = ""
    at_stop: bool = False

    def join(self, follow: str) -> tuple[list[int], str]:
        """(the model ids to keep, the text to append after them) for ``follow``, the text
        that must come after the stop string."""
        if follow.startswith(self.overhang) or len(self.ids) < 2:
            return self.ids, follow[len(self.overhang) :]
        return self.ids[:-1], self.text[len(self.prefix) :] + follow


def cut_turn(tokenizer: Any, ids: Sequence[int], stop_strings: Sequence[str]) -> Seam:
    """The turn's ``Seam``: its ids up to the first that completes one of ``stop_strings``
    (``turn_end``), the text to the string's end, and the overhang past it."""
    keep = turn_end(tokenizer, ids, stop_strings)
    kept = [int(i) for i in ids[:keep]]
    text = tokenizer.hf.decode(kept, skip_special_tokens=False)
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    if keep == len(ids) and not ends:
        return Seam(kept, text)
    end = min(ends)
    prefix = tokenizer.hf.decode(kept[:-1], skip_special_tokens=False)
    return Seam(kept, text[:end], text[end:], prefix, at_stop=True)
