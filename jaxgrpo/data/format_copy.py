"""format_copy: a synthetic, offline task that teaches the answer format and nothing else.

The model is asked to copy an integer into exactly one ``<answer>`` tag. It needs no data
download, is deterministic by seed, and has a one-line verifiable reward, which makes it the
embedded default for demos and smoke tests (configs/format_copy.py).

Train/eval are disjoint by construction: the eval set is a fixed list of ``num_eval`` integers
drawn once with a private seed, and train sampling rejects those integers (and the worked
example's integer).

Worked-example curriculum (train only). Without an example SmolLM2-135M-Instruct does not
write the tag at temperature 1, so GRPO on plain prompts only learns "say the number" and
stalls at the bare number; with the example as a previous user/assistant turn it writes the
exact answer in some samples, with reward variance in every group. ``train_example_prob``
shows the example on that fraction of training prompts, decaying linearly to 0 over the first
``train_example_decay`` examples of each ``train_examples`` list, so the policy first learns
the tag where it can see it and then has to produce it on plain prompts. Evaluation prompts
never carry it (unless ``worked_example``), so held-out accuracy measures the plain task.
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
      train_example_prob: probability that a training prompt carries the worked example at the
        start of each ``train_examples`` list (train only; see the module docstring).
      train_example_decay: number of training examples over which that probability falls
        linearly to 0 (example ``i`` gets ``prob * max(0, 1 - i / decay)``); 0 keeps it constant.
    """

    num_train: int = 2048
    num_eval: int = 64
    low: int = 0
    high: int = 100_000
    worked_example: bool = True
    system_prompt: str | None = None
    train_example_prob: float = 0.0
    train_example_decay: int = 0

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
        if not 0.0 <= self.train_example_prob <= 1.0:
            raise ValueError(f"train_example_prob={self.train_example_prob} is not in [0, 1]")
        if self.train_example_decay < 0:
            raise ValueError(f"train_example_decay={self.train_example_decay} is negative")

    def eval_numbers(self) -> list[int]:
        """The held-out integers, distinct, in a fixed order."""
        rng = np.random.default_rng(_EVAL_SEED)
        pool = np.arange(self.low, self.high, dtype=np.int64)
        pool = pool[pool != _EXAMPLE_NUMBER]
        return [int(n) for n in rng.choice(pool, size=self.num_eval, replace=False)]

    def _messages(self, number: int, example: bool) -> list[Message]:
        system = SYSTEM_PROMPT if self.system_prompt is None else self.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        if example:
            messages += [
                {"role": "user", "content": _user_text(_EXAMPLE_NUMBER)},
                {"role": "assistant", "content": f"<answer>{_EXAMPLE_NUMBER}</answer>"},
            ]
        return messages + [{"role": "user", "content": _user_text(number)}]

    def _example(self, number: int, example: bool) -> Example:
        return {"messages": self._messages(number, example), "answer": str(number)}

    def example_probs(self, n: int) -> np.ndarray:
        """float [n]: probability that train example ``i`` of a list shows the worked example."""
        probs = np.full(n, self.train_example_prob, dtype=np.float64)
        if self.train_example_decay > 0:
            ramp = 1.0 - np.arange(n, dtype=np.float64) / self.train_example_decay
            probs *= np.clip(ramp, 0.0, 1.0)
        return probs

    def train_examples(self, seed: int = 0) -> list[Example]:
        """``num_train`` examples drawn by ``seed`` (with replacement), never an eval integer."""
        held_out = np.array([*self.eval_numbers(), _EXAMPLE_NUMBER], dtype=np.int64)
        rng = np.random.default_rng(seed)
        numbers: list[int] = []
        while len(numbers) < self.num_train:
            draw = rng.integers(self.low, self.high, size=self.num_train, dtype=np.int64)
            draw = draw[~np.isin(draw, held_out)]
            numbers.extend(int(n) for n in draw[: self.num_train - len(numbers)])
        # A separate stream, so the curriculum never changes which integers are drawn.
        shown = np.random.default_rng([seed, 1]).random(self.num_train) < self.example_probs(
            self.num_train
        )
        shown |= self.worked_example
        return [self._example(n, bool(s)) for n, s in zip(numbers, shown, strict=True)]

    def eval_examples(self) -> list[Example]:
        """The fixed held-out examples (the worked example only when ``worked_example``)."""
        return [self._example(n, self.worked_example) for n in self.eval_numbers()]
