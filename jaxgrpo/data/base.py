"""Task protocol, prompt templates, row loading with located errors, and the train/eval split.

A task turns raw rows (a hub data set through `datasets`, or a local jsonl/json/parquet file in
the same schema) into examples, plain dicts:

    {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...],
     <reward columns, e.g. "answer", "reference", "tests">}

The trainer tokenizes ``messages`` with the model's chat template and hands the other columns to
the reward functions as keyword arguments (``jaxgrpo.rewards.inputs``). An example whose row
held its prompt as a chat (TRL's conversational format: a column of ``{"role", "content"}``
messages) also carries ``CHAT_ROW: True``, which is no reward column: it tells
``rewards.conversational="auto"`` to give reward functions TRL's message lists, as TRL does for
such data; a prompt built from text columns gives them strings.

Every row keeps its origin (file or hub id, and its 1-based row number), so a malformed row fails
with ``MalformedRowError("path: row 7: missing field 'answer'")`` instead of a bare ``KeyError``
deep inside training.

Train/eval never overlap: examples are keyed by a hash of their normalised prompt text and any
train example whose key appears in the eval set is dropped (``split_by_hash`` and
``RowTask.train_examples``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from jaxgrpo.core.errors import UserError, require

_LOG = logging.getLogger(__name__)

Example = dict[str, Any]
Message = dict[str, str]

# The seed study's instruction (sent verbatim with every GSM8K/JEE question).
ANSWER_TAG_INSTRUCTION = (
    "Solve this question by reasoning step by step and enclose the final answer in "
    "<answer></answer>"
)
# DeepSeek-R1-Zero style system prompt: think first, then answer, each in its own tag.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process and then gives the "
    "answer. The reasoning process and the answer are enclosed within <think> </think> and "
    "<answer> </answer> tags respectively, i.e. <think> reasoning here </think> "
    "<answer> answer here </answer>."
)
TEMPLATES = ("answer_tag", "r1", "none")
CHAT_ROW = "chat_row"  # key of an example whose row held its prompt as chat messages
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures")


class MalformedRowError(UserError, ValueError):
    """A data row lacks a field or cannot be parsed; the message names file, row and field."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One raw record and where it came from.

    Attributes:
      data: the record as read (column name -> value).
      source: file path or ``hub_id[split]``.
      number: 1-based row number (line number for jsonl).
    """

    data: dict[str, Any]
    source: str
    number: int

    def get(self, field: str, *, required: bool = True, default: Any = None) -> Any:
        """Returns ``data[field]``; a missing or null required field raises MalformedRowError."""
        value = self.data.get(field)
        if value is None and required:
            raise MalformedRowError(
                f"{self.source}: row {self.number}: missing field {field!r} "
                f"(row has {sorted(self.data)})"
            )
        return default if value is None else value

    def fail(self, why: str) -> MalformedRowError:
        """An error located at this row (raise it)."""
        return MalformedRowError(f"{self.source}: row {self.number}: {why}")


class Task(Protocol):
    """What the trainer and evaluator need from a task.

    Attributes:
      name: registry name, e.g. ``"gsm8k"``.
      columns: the reward columns every example carries besides ``messages``.
      default_rewards: ``(reward_name, weight)`` pairs used when the config names none.
    """

    name: str
    columns: tuple[str, ...]
    default_rewards: tuple[tuple[str, float], ...]

    def train_examples(self, seed: int = 0) -> Sequence[Example]:
        """Training examples, shuffled deterministically by ``seed``."""
        ...

    def eval_examples(self) -> Sequence[Example]:
        """Held-out examples in a fixed order; disjoint from every ``train_examples(seed)``."""
        ...


def build_messages(
    question: str, *, template: str = "answer_tag", system_prompt: str | None = None
) -> list[Message]:
    """Wraps a question in a prompt template.

    Args:
      question: the task's question text.
      template: ``"answer_tag"`` (the seed study's instruction, then a blank line, then the
        question), ``"r1"`` (R1-Zero system prompt, the question as the user turn), ``"none"``
        (the question alone), or a custom string containing ``{question}``.
      system_prompt: optional system turn; it replaces the R1 system prompt when both apply.

    Returns:
      Chat messages: an optional system turn, then one user turn.
    """
    if template == "answer_tag":
        user = f"{ANSWER_TAG_INSTRUCTION}\n\n{question}"
    elif template == "r1":
        user = question
        system_prompt = system_prompt or R1_SYSTEM_PROMPT
    elif template == "none":
        user = question
    elif "{question}" in template:
        user = template.replace("{question}", question)
    else:
        raise ValueError(
            f"unknown prompt template {template!r}: use one of {TEMPLATES} or a string "
            "containing '{question}'"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": user}]


def content_key(text: str) -> str:
    """Hash of whitespace-normalised, case-folded text: the identity used for train/eval."""
    normalised = " ".join(text.split()).casefold()
    return hashlib.sha256(normalised.encode("utf-8")).hexdigest()


def prompt_key(example: Example) -> str:
    """Content key of an example's non-system messages (the question as the model sees it)."""
    text = "\n".join(m["content"] for m in example["messages"] if m["role"] != "system")
    return content_key(text)


def is_local(source: str) -> bool:
    """True for an existing path or anything that looks like a file name rather than a hub id."""
    return os.path.exists(source) or source.endswith(_LOCAL_SUFFIXES) or source.startswith(".")


def read_local(path: str) -> list[Row]:
    """Reads a jsonl, json (a list of objects, or ``{"data": [...]}``) or parquet file.

    Raises:
      FileNotFoundError: the file does not exist.
      MalformedRowError: a line is not valid JSON or a row is not an object.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # Local import: only parquet users need pyarrow.

        records = pq.read_table(path).to_pylist()
        return [Row(_as_dict(r, path, i + 1), path, i + 1) for i, r in enumerate(records)]
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            records = json.load(f)
            if isinstance(records, dict) and isinstance(records.get("data"), list):
                records = records["data"]
            if not isinstance(records, list):
                raise MalformedRowError(f"{path}: expected a JSON list of objects")
            return [Row(_as_dict(r, path, i + 1), path, i + 1) for i, r in enumerate(records)]
        rows = []
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # Blank lines are allowed; row numbers stay equal to line numbers.
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MalformedRowError(f"{path}: row {number}: invalid JSON ({e.msg})") from e
            rows.append(Row(_as_dict(record, path, number), path, number))
        return rows


def _as_dict(record: Any, path: str, number: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise MalformedRowError(f"{path}: row {number}: expected an object, got {record!r:.60}")
    return record


def read_hub(hub_id: str, split: str, config: str | None = None) -> list[Row]:
    """Loads a hub data set split through ``datasets.load_dataset`` (downloads; users only)."""
    datasets = require("datasets", "data", f"loading the hub data set {hub_id!r}")
    records = datasets.load_dataset(hub_id, config, split=split)
    source = f"{hub_id}[{split}]"
    return [Row(dict(r), source, i + 1) for i, r in enumerate(records)]


def resolve_fixture(source: str, fixture: str) -> str:
    """Maps ``source="fixture"`` to the package's bundled file named ``fixture``."""
    return os.path.join(FIXTURE_DIR, fixture) if source == "fixture" else source


def split_by_hash(
    examples: Sequence[Example], eval_fraction: float
) -> tuple[list[Example], list[Example]]:
    """Deterministic content-based split: the eval set is the examples with the smallest keys.

    Sorting by key (not by position) makes the split independent of row order; the eval set holds
    ``round(n * eval_fraction)`` examples (at least one when ``n >= 2`` and the fraction > 0).

    Returns:
      ``(train, eval)`` with no shared prompt key; duplicates of an eval prompt leave train.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    keys = sorted({prompt_key(e) for e in examples})
    n_eval = round(len(keys) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(keys) >= 2:
        n_eval = 1
    eval_keys = set(keys[:n_eval])
    eval_set = [e for e in examples if prompt_key(e) in eval_keys]
    train = [e for e in examples if prompt_key(e) not in eval_keys]
    return train, eval_set


def shuffled(examples: Sequence[Example], seed: int) -> list[Example]:
    """A deterministic permutation of ``examples`` by ``seed`` (no global RNG state touched)."""
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order]


@dataclasses.dataclass
class RowTask:
    """A task backed by rows: hub splits, local files, or one source split by content hash.

    Subclasses set ``name``, ``columns``, ``default_rewards`` and implement ``to_example(row)``.

    Attributes:
      source: hub id, local file path, or ``"fixture"`` (the bundled sample file written for
        tests and offline demos); None means the task's public hub data set ``hub_id``.
      eval_source: optional separate eval file/hub id; defaults to ``source``.
      train_split / eval_split: hub split names; ``eval_split=None`` splits the train rows by
        content hash with ``eval_fraction``. Local files ignore split names.
      hub_config: the hub data set's configuration name (e.g. gsm8k's ``"main"``).
      eval_fraction: share of rows held out when no separate eval source or split exists.
      template / system_prompt: see ``build_messages``.
      num_train / num_eval: keep at most this many train / eval examples (None: all). The eval
        cap takes the first rows of the eval set, so it is the same set on every run.
      skip_malformed: drop malformed rows, with one warning per file naming how many and the
        first (e.g. MATH's train split has two empty ``\boxed{}`` answers); False: the first
        malformed row stops the load with its location.
    """

    source: str | None = None
    eval_source: str | None = None
    train_split: str = "train"
    eval_split: str | None = "test"
    hub_config: str | None = None
    eval_fraction: float = 0.2
    template: str = "answer_tag"
    system_prompt: str | None = None
    num_train: int | None = None
    num_eval: int | None = None
    skip_malformed: bool = False

    name: ClassVar[str] = "rows"
    columns: ClassVar[tuple[str, ...]] = ()
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = ()
    fixture: ClassVar[str] = ""  # File under jaxgrpo/data/fixtures used by source="fixture".
    hub_id: ClassVar[str] = ""  # The public data set used when source is None.

    def to_example(self, row: Row) -> Example:
        """Maps one raw row to an example dict; raises ``row.fail(...)`` on bad content."""
        raise NotImplementedError

    def messages(self, question: str) -> list[Message]:
        """The prompt for one question under this task's template and system prompt."""
        return build_messages(question, template=self.template, system_prompt=self.system_prompt)

    def _load(self, source: str, split: str) -> list[Example]:
        source = resolve_fixture(source, self.fixture)
        rows = read_local(source) if is_local(source) else read_hub(source, split, self.hub_config)
        if not self.skip_malformed:
            try:
                return [self.to_example(r) for r in rows]
            except MalformedRowError as error:
                raise MalformedRowError(f"{error} (skip_malformed=True drops such rows)") from None
        examples, bad = [], []
        for row in rows:
            try:
                examples.append(self.to_example(row))
            except MalformedRowError as error:
                bad.append(error)
        if bad:
            _LOG.warning("skipped %d malformed rows of %s, the first: %s", len(bad), source, bad[0])
        return examples

    def _splits(self) -> tuple[list[Example], list[Example]]:
        cached = getattr(self, "_cache", None)
        if cached is not None:
            return cached
        source = self.source or self.hub_id
        if not source:
            raise ValueError(f"task {self.name!r} needs source= (a local file or a hub id)")
        train = self._load(source, self.train_split)
        local = is_local(resolve_fixture(source, self.fixture))
        if self.eval_source is not None:
            eval_set = self._load(self.eval_source, self.eval_split or self.train_split)
        elif self.eval_split is not None and not local:
            eval_set = self._load(source, self.eval_split)
        else:
            train, eval_set = split_by_hash(train, self.eval_fraction)
        eval_keys = {prompt_key(e) for e in eval_set}
        train = [e for e in train if prompt_key(e) not in eval_keys]
        self._cache = (train[: self.num_train], eval_set[: self.num_eval])
        return self._cache

    def train_examples(self, seed: int = 0) -> list[Example]:
        """Training examples shuffled by ``seed``; none shares a prompt with the eval set."""
        return shuffled(self._splits()[0], seed)

    def eval_examples(self) -> list[Example]:
        """Held-out examples in source order."""
        return list(self._splits()[1])


def pick_column(row: Row, explicit: str | None, candidates: Iterable[str], what: str) -> Any:
    """Value of ``explicit`` if given, else of the first candidate column present in the row."""
    if explicit is not None:
        return row.get(explicit)
    for name in candidates:
        if row.data.get(name) is not None:
            return row.data[name]
    raise row.fail(f"missing field for {what}: none of {list(candidates)} present")


def require_str(row: Row, value: Any, field: str) -> str:
    """Checks that a field holds a non-empty string (numbers are converted)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise row.fail(f"field {field!r} must be a non-empty string, got {value!r:.60}")
    return value
