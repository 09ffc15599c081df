"""format_copy: a synthetic, offline task that teaches the answer format and nothing else.

The model is asked to copy an integer into exactly one ``<answer>`` tag. It needs no data
download, is deterministic by seed, and has a one-line verifiable reward, which makes it the
embedded default for demos and smoke tests (configs/format_copy.py).

Train/eval are disjoint by construction: the eval set is a fixed list of ``num_eval`` integers
drawn once with a private seed, and train sampling rejects those integers (and the worked
example's integer).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jaxgrpo.data.base import Example, Message

SYSTEM_PROMPT = (
    "You are a strict formatter. Reply with exactly one <answer></answer> tag that contains "
    "the requested value, and write nothing outside the tag."
)
_EVAL_SEED = 20_260_704  # Private seed of the held-out integers; never used for training.
_EXAMPLE_NUMBER = 4_096  # The worked example's integer; excluded from both train and eval.


def _user_text(number: int) -> str:
    return f"Copy this integer exactly: {number}"


@dataclasses.dataclass
class FormatCopyTask:
    """Copy an integer into ``<answer>N</answer>``.

    Attributes:
      num_train: examples per ``train_examples(seed)`` call.
      num_eval: size of the fixed held-out set.
      low / high: integers are drawn uniformly from ``[low, high)``.
      worked_example: prepend one user/assistant exchange showing the exact format.
      system_prompt: overrides the strict-formatter system prompt (None keeps it, "" drops it).
    """

    num_train: int = 2048
    num_eval: int = 64
    low: int = 0
    high: int = 100_000
    worked_example: bool = True
    system_prompt: str | None = None

    name: ClassVar[str] = "format_copy"
    columns: ClassVar[tuple[str, ...]] = ("answer",)
    # format_copy's partial-credit reward already gives 1.0 only to the exact "<answer>N</answer>".
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (("format_copy", 1.0),)

    def __post_init__(self):
        # Train must still have numbers left after holding out the eval set and the example.
        if self.high - self.low < 4 * (self.num_eval + 1):
            raise ValueError(
                f"format_copy range [{self.low}, {self.high}) is too small for "
                f"num_eval={self.num_eval}; widen low/high"
            )

    def eval_numbers(self) -> list[int]:
        """The held-out integers, distinct, in a fixed order."""
        rng = np.random.default_rng(_EVAL_SEED)
        pool = np.arange(self.low, self.high, dtype=np.int64)
        pool = pool[pool != _EXAMPLE_NUMBER]
        return [int(n) for n in rng.choice(pool, size=self.num_eval, replace=False)]

    def _messages(self, number: int) -> list[Message]:
        system = SYSTEM_PROMPT if self.system_prompt is None else self.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        if self.worked_example:
            messages += [
                {"role": "user", "content": _user_text(_EXAMPLE_NUMBER)},
                {"role": "assistant", "content": f"<answer>{_EXAMPLE_NUMBER}</answer>"},
            ]
        return messages + [{"role": "user", "content": _user_text(number)}]

    def _example(self, number: int) -> Example:
        return {"messages": self._messages(number), "answer": str(number)}

    def train_examples(self, seed: int = 0) -> list[Example]:
        """``num_train`` examples drawn by ``seed`` (with replacement), never an eval integer."""
        held_out = np.array([*self.eval_numbers(), _EXAMPLE_NUMBER], dtype=np.int64)
        rng = np.random.default_rng(seed)
        numbers: list[int] = []
        while len(numbers) < self.num_train:
            draw = rng.integers(self.low, self.high, size=self.num_train, dtype=np.int64)
            draw = draw[~np.isin(draw, held_out)]
            numbers.extend(int(n) for n in draw[: self.num_train - len(numbers)])
        return [self._example(n) for n in numbers]

    def eval_examples(self) -> list[Example]:
        """The fixed held-out examples."""
        return [self._example(n) for n in self.eval_numbers()]
