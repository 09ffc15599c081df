"""``python``: a tool that runs the model's Python in the code sandbox and returns what it printed.

Each call is a fresh ``python -I -S`` process under every layer of ``rewards.code``'s sandbox
(namespaces, resource limits, the audit hook, a killed process group past the timeout), with
reads confined as well, since the output goes back to the model. Nothing carries over between
calls. The result is the code's stdout, cut to ``MAX_OUTPUT_CHARS``, then the last line of the
traceback when it raised; every failure is text the model reads, never an exception, and a
``FailedResult``, so the rollout counts the call as failed (``raised`` or ``timeout``).
"""

from __future__ import annotations

from jaxgrpo.agents.schema import FailedResult
from jaxgrpo.rewards.code import run_sandboxed

TIMEOUT_S = 5.0  # wall-clock seconds per call (CPU seconds are capped just above it)
MEMORY_MB = 512  # the process's address space
MAX_OUTPUT_CHARS = 2_000  # longer output is cut to its first this many characters
MAX_ERROR_CHARS = 500  # the traceback's last line is cut to this
NO_OUTPUT = "(no output: print the value you need)"


def python(code: str) -> str:
    """Runs a Python program in a fresh sandboxed interpreter and returns what it printed.

    Args:
        code: The program (standard library only), e.g. print(sum(i * i for i in range(10))).
            Each call starts afresh: print every value you need.

    Returns:
        What it printed, then the traceback's last line if it raised, or an "Error:" line.
    """
    # UTF-8 takes at most 4 bytes a character: this many bytes hold MAX_OUTPUT_CHARS of them.
    max_bytes = 4 * MAX_OUTPUT_CHARS
    run = run_sandboxed(
        {"mode": "run", "code": code}, timeout=TIMEOUT_S, memory_mb=MEMORY_MB, max_bytes=max_bytes
    )
    output = run.output.decode(errors="replace")
    lines = [output[:MAX_OUTPUT_CHARS].rstrip("\n")] if output.strip() else []
    if len(output) > MAX_OUTPUT_CHARS or run.output_bytes > len(run.output):
        lines.append(f"(output cut to its first {MAX_OUTPUT_CHARS} characters)")
    status, _, error = run.report.decode(errors="replace").rstrip("\n").partition(" ")
    if run.timed_out:
        lines.append(f"Error: the program ran longer than {TIMEOUT_S:g} s and was stopped")
        return FailedResult("\n".join(lines), "timeout")
    if status == "raised":
        lines.append(error[:MAX_ERROR_CHARS])
        return FailedResult("\n".join(lines), "raised")
    if status != "done":
        lines.append("Error: the program ended before finishing (a crash or os._exit)")
        return FailedResult("\n".join(lines), "raised")
    return "\n".join(lines) or NO_OUTPUT
