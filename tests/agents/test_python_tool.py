"""``agents.python_tool.python``: the model's code in the code sandbox, its prints back as text,
an exception as its traceback's last line, and every limit as text rather than an exception."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from jaxgrpo.agents import python_tool
from jaxgrpo.agents.formats import ToolCall
from jaxgrpo.agents.python_tool import MAX_OUTPUT_CHARS, NO_OUTPUT, python
from jaxgrpo.agents.schema import tool_schema
from jaxgrpo.agents.tools import TOOLS, Toolbox, ToolResult


def test_prints_come_back():
    assert python("import math\nprint(6 * 7)\nprint(math.comb(5, 2))") == "42\n10"
    assert python("x = 1") == NO_OUTPUT
    assert python("import sys\nprint('bye')\nsys.exit(0)") == "bye"


def test_an_exception_gives_its_last_traceback_line_after_the_output():
    raised = python("print('before')\n1 / 0")
    assert raised == "before\nZeroDivisionError: division by zero" and raised.kind == "raised"
    assert not hasattr(python("print(1)"), "kind"), "a program that ran is not a failure"
    assert python("def f(:\n    pass") == "SyntaxError: invalid syntax"
    assert python("import sys\nsys.exit(3)") == "SystemExit: 3"
    assert python("x = bytearray(10 * 1024**3)") == "MemoryError"


def test_an_endless_loop_is_stopped_and_its_earlier_output_kept(monkeypatch):
    monkeypatch.setattr(python_tool, "TIMEOUT_S", 1.0)
    t0 = time.perf_counter()
    out = python("print('started')\nwhile True:\n    pass")
    assert time.perf_counter() - t0 < 3.0, "the process group is killed at the timeout"
    assert out == "started\nError: the program ran longer than 1 s and was stopped"
    assert out.kind == "timeout", "a stopped program counts as a failed call"


@pytest.mark.parametrize(
    "code",
    [
        "print(open('/etc/passwd').read())",
        "import os\nprint(os.listdir('/'))",
        "import pathlib\nprint(list(pathlib.Path('/proc/1').iterdir()))",
        "import sqlite3\nsqlite3.connect('file:/tmp/escaped.db?mode=rwc', uri=True)",
        "import spwd\nprint(spwd.getspall())",
        "import _xxsubinterpreters",
    ],
)
def test_reading_outside_its_directory_is_refused(code):
    assert "PermissionError: sandbox:" in python(code)


def test_writing_outside_its_directory_is_refused_and_inside_allowed(tmp_path):
    target = tmp_path / "escaped.txt"
    out = python(f"open({str(target)!r}, 'w').write('x')")
    assert out == "PermissionError: sandbox: writing outside the working directory"
    assert not target.exists()
    assert python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())") == "hi"


def test_long_output_is_cut_with_a_note_and_the_error_kept():
    out = python("print('x' * 5000)\n1 / 0").split("\n")
    note = f"(output cut to its first {MAX_OUTPUT_CHARS} characters)"
    assert out == ["x" * MAX_OUTPUT_CHARS, note, "ZeroDivisionError: division by zero"]


def test_python_is_a_well_described_builtin_tool():
    fn = tool_schema(python)["function"]
    assert fn["name"] == "python"
    assert fn["parameters"]["required"] == ["code"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"
    assert "print" in fn["parameters"]["properties"]["code"]["description"]
    assert TOOLS["python"] is python


def test_a_call_through_the_toolbox_returns_the_printed_text():
    call = ToolCall(name="python", arguments={"code": "print(sum(range(10)))"}, raw="")
    assert Toolbox([python]).run(call, timeout_s=30.0) == ToolResult("45")
    failing = ToolCall(name="python", arguments={"code": "[][0]"}, raw="")
    result = Toolbox([python]).run(failing, timeout_s=30.0)
    # The model reads its text as it is; the call counts as a failed one.
    assert result == ToolResult("IndexError: list index out of range", "raised")
    assert type(result.text) is str


def test_on_a_worker_thread_the_tool_timeout_stops_the_program():
    """Off the main thread (the producer thread of asynchronous rollouts) a program past
    ``agent.tool_timeout_s``, shorter than the sandbox's own ``TIMEOUT_S``, is stopped at it
    (its process group killed as the call unwinds), and the thread runs the next call."""
    box, spin = Toolbox([python]), ToolCall("python", {"code": "while True:\n    pass"}, "")

    def work():
        t0 = time.perf_counter()
        result = box.run(spin, timeout_s=0.5)
        took = time.perf_counter() - t0
        return result, took, box.call("python", {"code": "print(6 * 7)"}, 30.0)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result, took, after = pool.submit(work).result(timeout=60)
    assert result == ToolResult("{'error': 'Tool python timed out after 0.5 s.'}", "timeout")
    assert took < python_tool.TIMEOUT_S - 2, "the tool's limit, not the sandbox's"
    assert after == ToolResult("42")
