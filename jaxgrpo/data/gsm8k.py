"""GSM8K and GSM8K with distilled R1 reasoning traces.

``gsm8k`` reads openai/gsm8k (config ``main``; splits train/test) or local files with the same
columns: ``question`` and ``answer``, where ``answer`` is the worked solution ending in
``#### <number>`` and may contain calculator annotations ``<<48/2=24>>``.

``gsm8k_r1_traces`` reads CK0607/gsm8k-r1-llama70b (the seed study's reasoning traces from
deepseek-r1-distill-llama-70b). Its schema is not documented; we expect, per row,

    question  the GSM8K question                      (``question_column``)
    answer    the final answer, a number or a GSM8K-style solution with ``####``
                                                       (``answer_column``)
    trace     the reasoning trace; the first present of ``TRACE_CANDIDATES`` unless
              ``trace_column`` names it                (``trace_column``)

and every column name is configurable. ``<think>`` tags are removed from the trace.

Examples carry ``answer`` (the final number as a string) and ``reference`` (the worked reasoning
without calculator annotations or the ``####`` line: what the embedding/BLEU/perplexity rewards
compare against).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, pick_column, require_str

_CALC_RE = re.compile(r"<<[^<>]*>>")
_THINK_RE = re.compile(r"</?think>")
TRACE_CANDIDATES = ("trace", "reasoning", "r1_trace", "response", "r1_response", "output")


def split_solution(row: Row, solution: str) -> tuple[str, str]:
    """Splits a GSM8K solution into (reasoning, final answer) at its last ``####``.

    Args:
      row: the row, for located errors.
      solution: text like ``"Half of 48 is <<48/2=24>>24.\\n#### 24"``.

    Returns:
      The reasoning with calculator annotations removed, and the answer with thousands
      separators removed (``"1,000"`` -> ``"1000"``).
    """
    if "####" not in solution:
        raise row.fail("field 'answer' has no '#### <final answer>' line")
    reasoning, _, final = solution.rpartition("####")
    final = final.strip().replace(",", "")
    if not final:
        raise row.fail("field 'answer' has an empty final answer after '####'")
    return _CALC_RE.sub("", reasoning).strip(), final


@dataclasses.dataclass
class GSM8KTask(RowTask):
    """Grade-school math word problems with numeric answers (openai/gsm8k schema)."""

    hub_config: str | None = "main"

    name: ClassVar[str] = "gsm8k"
    columns: ClassVar[tuple[str, ...]] = ("answer", "reference")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (
        ("exact_answer", 1.0),
        ("format", 0.2),
    )
    fixture: ClassVar[str] = "gsm8k.jsonl"
    hub_id: ClassVar[str] = "openai/gsm8k"

    def to_example(self, row: Row) -> Example:
        question = require_str(row, row.get("question"), "question")
        reasoning, final = split_solution(row, require_str(row, row.get("answer"), "answer"))
        return {"messages": self.messages(question), "answer": final, "reference": reasoning}


@dataclasses.dataclass
class GSM8KTracesTask(RowTask):
    """GSM8K questions with distilled R1 reasoning traces as the soft-reward reference.

    Attributes:
      question_column / answer_column: column names of the question and the final answer.
      trace_column: the reasoning column (None: first of ``TRACE_CANDIDATES`` present).
    """

    eval_split: str | None = None  # The hub data set has a train split only.
    question_column: str = "question"
    answer_column: str = "answer"
    trace_column: str | None = None

    name: ClassVar[str] = "gsm8k_r1_traces"
    columns: ClassVar[tuple[str, ...]] = ("answer", "reference")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (
        ("exact_answer", 1.0),
        ("embedding", 0.5),
    )
    fixture: ClassVar[str] = "gsm8k_r1_traces.jsonl"
    hub_id: ClassVar[str] = "CK0607/gsm8k-r1-llama70b"

    def to_example(self, row: Row) -> Example:
        question = require_str(row, row.get(self.question_column), self.question_column)
        answer = require_str(row, row.get(self.answer_column), self.answer_column)
        if "####" in answer:
            answer = split_solution(row, answer)[1]
        trace = pick_column(row, self.trace_column, TRACE_CANDIDATES, "the reasoning trace")
        trace = _THINK_RE.sub("", require_str(row, trace, "trace")).strip()
        return {
            "messages": self.messages(question),
            "answer": answer.strip().replace(",", ""),
            "reference": trace,
        }
