"""code_tests: correct scoring, and hostile programs end with reward 0 and a healthy trainer."""

import os
import socket
import time

import pytest

from jaxgrpo.rewards.code import code_tests, extract_code, namespace_prefix, run_tests

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
TIMEOUT = 2.0  # seconds per sandboxed run in these tests


def _fence(code):
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


def _reward(code, tests=("assert True",), **kwargs):
    return code_tests(["p"], [_fence(code)], tests=[list(tests)], timeout=TIMEOUT, **kwargs)[0]


def test_extract_code_prefers_last_python_block():
    text = "```\nplain\n```\n```python\nfirst\n```\n```py\nsecond\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nonly plain\n```") == "only plain\n"
    assert extract_code("def f(): pass") is None


def test_fraction_of_tests_passed_and_no_block_scores_zero():
    completions = [
        _fence("def add(a, b):\n    return a + b"),
        _fence("def add(a, b):\n    return 0"),
        "def add(a, b): return a + b",  # no fenced block
    ]
    got = code_tests(["p"] * 3, completions, tests=[TESTS] * 3, timeout=TIMEOUT)
    assert got == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert code_tests(["p"], [completions[0]], tests=[[]]) == [None]


def test_setup_code_runs_first_and_exit_or_fake_output_earns_nothing():
    setup = "import math"
    assert _reward("def r(x):\n    return math.sqrt(x)", ["assert r(9) == 3"], setup=[setup]) == 1.0
    assert _reward("import sys\nsys.exit(0)") == 0.0
    assert _reward("import os\nos._exit(0)") == 0.0
    assert _reward("print('0 0 1')\nprint('passed')\nraise SystemExit") == 0.0


def test_infinite_loop_times_out():
    start = time.monotonic()
    assert _reward("while True:\n    pass") == 0.0
    assert time.monotonic() - start < TIMEOUT + 3.0


def test_infinite_loop_in_one_test_keeps_earlier_passes():
    code = "def f(n):\n    while n:\n        pass\n    return 1"
    assert _reward(code, ["assert f(0) == 1", "assert f(1) == 1"]) == 0.5


def test_fork_bomb_scores_zero_and_leaves_no_processes():
    before = _children()
    assert _reward("import os\nwhile True:\n    os.fork()") == 0.0
    assert _reward("import subprocess\nsubprocess.run(['sleep', '30'])") == 0.0
    assert _children() == before


def test_10gb_allocation_scores_zero():
    assert _reward("x = bytearray(10 * 1024 ** 3)\nx[-1] = 1") == 0.0


def test_writing_outside_its_directory_scores_zero(tmp_path):
    target = tmp_path / "escaped.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        "open('../escaped.txt', 'w').write('x')",
        "import os\nos.symlink('/tmp', 'link')\nopen('link/escaped.txt', 'w').write('x')",
        # A directory fd would let dir_fd-relative calls escape where the audit path looks local.
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.close(os.open('escaped.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        f"import os\nos.mkdir({str(tmp_path / 'escaped.txt')!r})",
    ]
    for code in attempts:
        assert _reward(code) == 0.0, code
    assert not target.exists()
    # Writing inside its own directory is allowed, and the directory is removed afterwards.
    inside = "open('a.txt', 'w').write('x')\nimport os\nos.mkdir('d')\nos.rename('a.txt', 'd/b')"
    checks = [
        "assert open('d/b').read() == 'x'",
        "import shutil\nshutil.rmtree('d')\nassert not os.path.exists('d')",
        "import tempfile\nwith tempfile.TemporaryFile() as f:\n    f.write(b'x')",
    ]
    assert _reward(inside, checks) == 1.0
    before = set(os.listdir(tmp_path))
    run_tests(inside, ["assert True"], timeout=TIMEOUT, tmp_root=str(tmp_path))
    assert set(os.listdir(tmp_path)) == before, "sandbox directory was not removed"


def test_opening_a_socket_scores_zero_and_reaches_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    try:
        assert _reward(code + "\ns.sendall(b'x')") == 0.0
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("JAXGRPO_SECRET_TOKEN", "hunter2")
    assert _reward("import os", ["assert 'JAXGRPO_SECRET_TOKEN' not in os.environ"]) == 1.0


def test_os_level_layers_hold_without_the_audit_hook():
    """The rlimits (and namespaces, where unshare works) are in force for the generated code."""
    limits = [
        "import resource",
        "assert resource.getrlimit(resource.RLIMIT_AS) == (256 * 2**20, 256 * 2**20)",
        "assert resource.getrlimit(resource.RLIMIT_FSIZE)[1] == 2**20",
        "assert resource.getrlimit(resource.RLIMIT_NPROC)[1] == 1",
    ]
    assert _reward("import os", limits, memory_mb=256) == 1.0
    if not namespace_prefix():
        pytest.skip("unshare unavailable here: network isolation rests on the audit hook")
    # A fresh network namespace has only a (down) loopback; a fresh PID namespace starts at 1.
    netns = ["assert [l.split(':')[0].strip() for l in open('/proc/net/dev')][2:] == ['lo']"]
    assert _reward("import os", [*netns, "assert os.getpid() == 1"]) == 1.0


def _children():
    """PIDs whose parent is this process (sandbox runs must leave none behind)."""
    me, found = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    found.add(pid)
        except OSError:
            continue
    return found
