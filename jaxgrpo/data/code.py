"""MBPP-style code generation: a short task description plus ``assert`` test cases.

Schemas read (hub google-research-datasets/mbpp or local jsonl/json/parquet):

- ``full`` config: ``text`` (the task), ``code`` (reference solution), ``test_list`` (assert
  strings), ``test_setup_code`` (optional), ``challenge_test_list`` (optional, ignored).
- ``sanitized`` config: ``prompt`` instead of ``text`` and ``test_imports`` (a list of import
  lines) instead of ``test_setup_code``.

The prompt shows the first test so the model knows the function's name and signature (MBPP's own
convention). Examples carry ``tests`` (list of assert strings), ``setup`` (code run before the
tests, may be empty) and ``reference`` (the reference solution) for the ``code_tests`` reward.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxgrpo.data.base import Example, Row, RowTask, pick_column, require_str

CODE_INSTRUCTION = (
    "Write a Python function for the task below. Reply with the complete code in one "
    "```python``` block."
)


@dataclasses.dataclass
class CodeTask(RowTask):
    """MBPP-style Python problems checked by assert statements."""

    hub_config: str | None = "full"
    template: str = "none"
    system_prompt: str | None = CODE_INSTRUCTION

    name: ClassVar[str] = "code"
    columns: ClassVar[tuple[str, ...]] = ("tests", "setup", "reference")
    default_rewards: ClassVar[tuple[tuple[str, float], ...]] = (("code_tests", 1.0),)
    fixture: ClassVar[str] = "mbpp.jsonl"
    hub_id: ClassVar[str] = "google-research-datasets/mbpp"

    def to_example(self, row: Row) -> Example:
        text = require_str(row, pick_column(row, None, ("text", "prompt"), "the task"), "text")
        tests = row.get("test_list")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise row.fail(
                f"field 'test_list' must be a non-empty list of strings, got {tests!r:.60}"
            )
        setup = row.get("test_setup_code", required=False, default="")
        imports = row.get("test_imports", required=False, default=[])
        setup = "\n".join([*imports, setup]).strip()
        question = f"{text.strip()}\nYour code should pass this test:\n{tests[0]}"
        return {
            "messages": self.messages(question),
            "tests": list(tests),
            "setup": setup,
            "reference": require_str(row, row.get("code"), "code"),
        }
