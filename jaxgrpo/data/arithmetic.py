"""arithmetic: seeded, offline grade-school word problems in GSM8K's format, for laptop studies.

GSM8K itself is out of reach of a 135M model (SmolLM2-135M-Instruct solves almost none), so a
study of reward structures on such a model measures nothing. This task keeps GSM8K's shape (a
short word problem, a worked reasoning, a numeric final answer, the seed study's prompt) at a
difficulty set by ``ops`` (arithmetic steps per problem) and ``max_number``. Every example
carries ``answer`` and ``reference`` (the worked reasoning, which the embedding, BLEU and
perplexity rewards compare against), like ``gsm8k`` examples.

Problems are drawn from a few sentence templates with a seeded generator. ``kind="expression"``
asks for one operation on two numbers instead ("What is 913 * 510?"), TRL's calculator
task: with numbers a small model cannot add or multiply in its head, a calculator decides the
outcome, and the call is easy to write. The held-out set is
the first ``num_eval`` of a fixed list of ``HELD_OUT`` problems drawn with a private seed, and
training draws reject every question of that list, so a larger evaluation than the training
run's (``jaxgrpo.evaluate --max_examples``) still holds out what it scores.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jaxgrpo.data.base import Example, build_messages, content_key

_EVAL_SEED = 20_261_202  # Private seed of the held-out problems; never used for training.
HELD_OUT = 1024  # Problems in the fixed held-out list (num_eval takes its first ones).
_NAMES = ("Ava", "Ben", "Cara", "Dev", "Emma", "Finn", "Gia", "Hugo", "Ines", "Jack", "Lena")
# The worked example; its name and item are in no drawn problem, so it never repeats one.
_EXAMPLE = (
    "Mia has 4 bags with 3 pens in each bag. Then Mia gets 5 more pens. How many pens does Mia "
    "have now?",
    "Mia has 4 bags of 3 pens, so 4 * 3 = 12 pens. Getting 5 more gives 12 + 5 = 17. Mia has 17 "
    "pens now.",
    "17",
)
# The worked example's answer when the run has the calculator tool (``agents.calc``, the tag
# format: the call, then its result, in the same turn).
_WORKED_CALC = (
    "Mia has 4 bags of 3 pens and gets 5 more: <calc>4*3+5</calc><result>17</result> Mia has 17 "
    "pens now."
)
# The expression kind's two worked examples (TRL's calculator prompt shows two), in words or
# with the calculator.
_EXPRESSIONS = ((12, "*", 34), (250, "+", 117))
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "coins", "shells", "cookies")


def _first_step(rng: np.random.Generator, name: str, item: str, high: int) -> tuple:
    """(sentence, reasoning, value) of a problem's opening fact."""
    if rng.random() < 0.5:
        a = int(rng.integers(2, high + 1))
        return f"{name} has {a} {item}.", f"{name} starts with {a} {item}.", a
    boxes, each = (int(x) for x in rng.integers(2, min(high, 10) + 1, size=2))
    return (
        f"{name} has {boxes} bags with {each} {item} in each bag.",
        f"{name} has {boxes} bags of {each} {item}, so {boxes} * {each} = {boxes * each} {item}.",
        boxes * each,
    )


def _next_step(rng: np.random.Generator, name: str, item: str, value: int, high: int) -> tuple:
    """(sentence, reasoning, value) of one more step applied to ``value``."""
    kind = rng.integers(3) if value > 2 else 0
    if kind == 0:
        b = int(rng.integers(2, high + 1))
        return (
            f"Then {name} gets {b} more {item}.",
            f"Getting {b} more gives {value} + {b} = {value + b}.",
            value + b,
        )
    if kind == 1:
        b = int(rng.integers(1, value))
        return (
            f"Then {name} gives {b} {item} to a friend.",
            f"Giving away {b} leaves {value} - {b} = {value - b}.",
            value - b,
        )
    b = int(rng.integers(2, 4))
    return (
        f"Then the number of {item} {name} has becomes {b} times as large.",
        f"{b} times as many is {value} * {b} = {value * b}.",
        value * b,
    )


def make_expression(rng: np.random.Generator, high: int) -> tuple[str, str, str]:
    """(question, reasoning, answer) of one operation on two numbers in 10..``high`` (a
    difference is never negative)."""
    op = "+-*"[rng.integers(3)]
    a, b = (int(x) for x in rng.integers(10, high + 1, size=2))
    if op == "-" and b > a:
        a, b = b, a
    value = _OPS[op](a, b)
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.", str(value)


def _worked_expression(a: int, op: str, b: int, calc: bool) -> str:
    value = _OPS[op](a, b)
    shown = (
        f"<calc>{a}{op}{b}</calc><result>{value}</result>" if calc else f"{a} {op} {b} = {value}."
    )
    return f"{shown} <answer>{value}</answer>"


def make_problem(rng: np.random.Generator, ops: int, high: int) -> tuple[str, str, str]:
    """(question, reasoning, answer) of one problem with ``ops`` arithmetic steps."""
    name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
    sentence, reasoning, value = _first_step(rng, name, item, high)
    sentences, steps = [sentence], [reasoning]
    for _ in range(ops - 1):
        sentence, reasoning, value = _next_step(rng, name, item, value, high)
        sentences.append(sentence)
        steps.append(reasoning)
    sentences.append(f"How many {item} does {name} have now?")
    steps.append(f"{name} has {value} {item} now.")
    return " ".join(sentences), " ".join(steps), str(value)


@dataclasses.dataclass
class ArithmeticTask:
    """Word problems of ``ops`` steps (1 = one fact, 2 = a fact and one change, ...).

    Attributes:
      num_train: examples per ``train_examples(seed)`` call.
      num_eval: held-out problems: the first ones of the fixed list (at most ``HELD_OUT``).
      ops: arithmetic facts per problem (1..4) of the word problems.
      max_number: largest number a problem states.
      kind: ``"word"`` problems, or ``"expression"``: "What is a op b?" with a and b in
        10..``max_number`` and op one of + - * (two worked examples with ``worked_example``).
      worked_calls: with ``worked_calc``, how many of the expression kind's two worked examples
        call the calculator (the last ones; the others answer in words). TRL's calculator
        prompt shows two calls, with which SmolLM2-135M calls it in every episode untrained.
      template / system_prompt: see ``jaxgrpo.data.build_messages`` (default: the seed study's
        instruction).
      worked_example: prepend one solved problem (same template, answer in the tag) as a
        previous user/assistant turn, on train and held-out prompts alike. A small model does not
        write ``<answer>`` tags from the instruction alone (SmolLM2-135M: 0% format), so without
        it the hard reward has no signal to start from.
      worked_calc: the worked example computes with the calculator tool (``<calc>4*3+5</calc>``
        answered by ``<result>17</result>``), for runs with ``agent.tools = ("calc",)`` in the
        tag format; otherwise it reasons in words.
    """

    num_train: int = 2048
    num_eval: int = 64
    ops: int = 2
    max_number: int = 20
    template: str = "answer_tag"
    system_prompt: str | None = None
    worked_example: bool = False
    worked_calc: bool = False
    kind: str = "word"
    worked_calls: int = 2

    name: ClassVar[str] = "arithmetic"
    columns: ClassVar[tuple[str, ...]] = ("answer", "reference")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (("exact_answer", 1.0),)

    def __post_init__(self):
        if not 1 <= self.ops <= 4:
            raise ValueError(f"arithmetic ops={self.ops} is not in 1..4")
        if not 1 <= self.num_eval <= HELD_OUT:
            raise ValueError(f"arithmetic num_eval={self.num_eval} is not in 1..{HELD_OUT}")
        if self.max_number < 3:
            raise ValueError(f"arithmetic max_number={self.max_number} is below 3")
        if self.kind not in ("word", "expression"):
            raise ValueError(f"arithmetic kind={self.kind!r} is not 'word' or 'expression'")
        if not 0 <= self.worked_calls <= len(_EXPRESSIONS):
            raise ValueError(f"arithmetic worked_calls={self.worked_calls} is not in 0..2")
        if self.kind == "expression" and self.max_number < 40:
            raise ValueError(f"arithmetic expressions need max_number >= 40, not {self.max_number}")

    def _example(self, question: str, reasoning: str, answer: str) -> Example:
        messages = build_messages(
            question, template=self.template, system_prompt=self.system_prompt
        )
        if self.worked_example and self.kind == "expression":
            shots = []
            calls = self.worked_calls if self.worked_calc else 0
            for i, (a, op, b) in enumerate(_EXPRESSIONS):
                calc = i >= len(_EXPRESSIONS) - calls
                shots.append(build_messages(f"What is {a} {op} {b}?", template=self.template)[-1])
                shots.append({"role": "assistant", "content": _worked_expression(a, op, b, calc)})
            messages = messages[:-1] + shots + messages[-1:]
        elif self.worked_example:
            shown = build_messages(_EXAMPLE[0], template=self.template)[-1]
            worked = _WORKED_CALC if self.worked_calc else _EXAMPLE[1]
            solved = {"role": "assistant", "content": f"{worked} <answer>{_EXAMPLE[2]}</answer>"}
            messages = messages[:-1] + [shown, solved] + messages[-1:]
        return {"messages": messages, "answer": answer, "reference": reasoning}

    def _draw(self, rng: np.random.Generator, n: int, exclude: set[str]) -> list[tuple]:
        problems, seen, tries = [], set(exclude), 0
        while len(problems) < n:
            tries += 1
            if tries > 50 * n:
                raise ValueError(
                    f"arithmetic ops={self.ops} max_number={self.max_number} has too few distinct "
                    f"problems for {n} examples; raise max_number"
                )
            if self.kind == "expression":
                problem = make_expression(rng, self.max_number)
            else:
                problem = make_problem(rng, self.ops, self.max_number)
            key = content_key(problem[0])
            if key not in seen:
                seen.add(key)
                problems.append(problem)
        return problems

    def _held_out_problems(self) -> list[tuple]:
        """The fixed list of ``HELD_OUT`` problems (for these ``ops`` and ``max_number``)."""
        return self._draw(np.random.default_rng(_EVAL_SEED), HELD_OUT, set())

    def train_examples(self, seed: int = 0) -> list[Example]:
        """``num_train`` distinct problems drawn by ``seed``, none of them in the held-out list."""
        held_out = {content_key(p[0]) for p in self._held_out_problems()}
        problems = self._draw(np.random.default_rng([seed, 7]), self.num_train, held_out)
        return [self._example(*p) for p in problems]

    def eval_examples(self) -> list[Example]:
        """The first ``num_eval`` problems of the held-out list."""
        return [self._example(*p) for p in self._held_out_problems()[: self.num_eval]]
