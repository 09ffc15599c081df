"""``code_tests``: run generated Python against the task's asserts in a sandboxed process.

Generated code is hostile input. Each program runs in its own ``python -I -S`` process
(``run_sandboxed``, shared with the agents' ``python`` tool, which gets the code's stdout back),
under these layers (each one alone stops some attack; together they stop the test suite's cases):

1. **Namespaces** (when ``unshare`` works here; checked once and cached): ``unshare --net --pid
   --fork --kill-child`` (plus ``--map-root-user`` when not root) gives the child no network
   interface but a down loopback, and a PID namespace whose processes all die with it.
2. **Resource limits**, soft = hard so they cannot be raised again: ``RLIMIT_AS`` (memory),
   ``RLIMIT_CPU``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``.
   The trusted runner (``sandbox_runner.py``) sets them on itself as its first act, before it
   compiles a byte of generated code, instead of in a ``preexec_fn``: ``preexec_fn`` runs
   Python between fork and exec, which can deadlock when the parent has threads, and the
   trainer always has (XLA). The kernel does not apply ``RLIMIT_NPROC`` to root; there the PID
   namespace and the audit hook stop fork bombs.
3. **Audit hook** (``sys.addaudithook``, irremovable): refuses process creation (fork, exec,
   spawn, system, Popen), signals, sockets, ``ctypes`` and the other modules that reach memory
   or files from C unaudited, subinterpreters, heap walking (``gc.get_objects``) and
   any write (open for writing, remove, rename, mkdir, chmod, ...) that resolves outside the
   working directory (symlinks, ``dir_fd`` and fd arguments included); for the ``python`` tool,
   whose output the model reads, also any read or listing outside it and the standard library.
   It is also the no-network layer where namespaces are unavailable. It is a Python-level guard,
   not a proof against a determined in-process attacker (frame introspection can reach the
   runner's state); layers 1, 2 and 4 are OS-level.
4. **Process hygiene**: a fresh temporary working directory removed afterwards, an environment
   scrubbed to ``PATH``/``HOME``/``LANG``, stdin closed after the spec is read, stdout/stderr of
   the code discarded (the ``python`` tool keeps stdout, in a file bounded by ``RLIMIT_FSIZE``),
   a wall-clock timeout after which the whole process group is SIGKILLed.

Results travel as one line per test, tagged with a random nonce the generated code never sees
in its inputs, so printing "passed" or calling ``exit(0)`` earns nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import jaxgrpo.rewards.sandbox_runner as sandbox_runner

_CODE_BLOCK_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last fenced Python block (```python / ```py / ```py3), else the last fenced block of
    any language; None when the completion has no fenced block."""
    blocks = _CODE_BLOCK_RE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "py3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else None


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that work on this machine (network + PID namespaces), or ``()``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = [unshare, "--net", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        prefix.append("--map-root-user")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return tuple(prefix) if ok else ()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def sandbox_limits(timeout: float, memory_mb: int) -> dict[str, int]:
    """The child's resource limits (soft = hard): memory, CPU seconds ``int(timeout) + 2`` (the
    wall clock fires first), no new processes, 1 MiB files, 64 fds, no core dumps."""
    return {
        "RLIMIT_AS": memory_mb * 2**20,
        "RLIMIT_CPU": int(timeout) + 2,
        "RLIMIT_NPROC": 1,
        "RLIMIT_FSIZE": 2**20,
        "RLIMIT_NOFILE": 64,
        "RLIMIT_CORE": 0,
    }


def run_tests(
    code: str,
    tests: list[str],
    setup: str = "",
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    tmp_root: str | None = None,
) -> list[bool]:
    """Runs ``setup``, then ``code``, then each assert in ``tests`` in a sandboxed process.

    Args:
      code: the generated program.
      tests: test statements (MBPP asserts), each run in the program's namespace.
      setup: code run before the program (the task's imports/fixtures).
      timeout: wall-clock seconds for the whole run.
      memory_mb: RLIMIT_AS of the child, in MiB.
      tmp_root: where the temporary directory is made (default: the system temp dir).

    Returns:
      [len(tests)] booleans; a test the process did not report (crash, timeout) failed.
    """
    nonce = secrets.token_hex(16)
    spec = {"mode": "tests", "nonce": nonce, "code": code, "setup": setup or ""}
    spec["tests"] = list(tests)
    run = run_sandboxed(spec, timeout=timeout, memory_mb=memory_mb, tmp_root=tmp_root)
    return _parse_results(run.report.decode(errors="replace").splitlines(), nonce, len(tests))


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """What one sandboxed process left behind.

    Attributes:
      report: the runner's report (``sandbox_runner``'s fd 1), its first ``max_bytes``.
      output: what the code printed (``run`` mode), its first ``max_bytes``.
      output_bytes: the size of all it printed.
      timed_out: whether the wall-clock timeout stopped it.
    """

    report: bytes
    output: bytes
    output_bytes: int
    timed_out: bool


def run_sandboxed(
    spec: dict,
    *,
    timeout: float,
    memory_mb: int,
    tmp_root: str | None = None,
    max_bytes: int = 2**20,
) -> SandboxRun:
    """Runs ``sandbox_runner.py`` on ``spec`` (its ``mode`` and code; the limits are added)
    in a fresh temporary directory, removed afterwards, under every layer of the sandbox."""
    spec = {**spec, "limits": sandbox_limits(timeout, memory_mb)}
    with tempfile.TemporaryDirectory(prefix="jaxgrpo_sandbox_", dir=tmp_root) as root:
        work = os.path.join(root, "work")
        os.mkdir(work)
        # Report and output go to files, not pipes: RLIMIT_FSIZE bounds them, and a child that
        # floods its output cannot grow the trainer's memory.
        report_path, output_path = os.path.join(root, "report"), os.path.join(root, "output")
        with open(report_path, "w+b") as report, open(output_path, "w+b") as output:
            timed_out = _run_child(json.dumps(spec).encode(), work, report, output, timeout)
            report.seek(0)
            output.seek(0)
            return SandboxRun(
                report=report.read(max_bytes),
                output=output.read(max_bytes),
                output_bytes=os.fstat(output.fileno()).st_size,
                timed_out=timed_out,
            )


def _run_child(spec: bytes, work: str, report, output, timeout: float) -> bool:
    """Runs the child to its end or ``timeout``, then kills its group; whether it timed out."""
    proc = subprocess.Popen(
        [*namespace_prefix(), sys.executable, "-I", "-S", sandbox_runner.__file__],
        stdin=subprocess.PIPE,
        stdout=report,
        stderr=output,
        cwd=work,
        env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"},
        start_new_session=True,  # its own process group, killed whole below
    )
    try:
        proc.communicate(spec, timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        _kill_group(proc)


def _parse_results(lines: list[str], nonce: str, num_tests: int) -> list[bool]:
    passed = [False] * num_tests
    for line in lines:
        fields = line.split(" ")
        if len(fields) == 3 and fields[0] == nonce and fields[1].isdigit() and fields[2] == "1":
            index = int(fields[1])
            if index < num_tests:
                passed[index] = True
    return passed


def code_tests(
    prompts: list[str],
    completions: list[str],
    *,
    tests: list,
    setup: list | None = None,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_workers: int = 4,
    **_,
) -> list[float | None]:
    """``r_i = (# asserts of tests_i that pass) / len(tests_i)`` running ``extract_code(c_i)``.

    No fenced code block scores 0.0; a sample without tests scores None. Completions run in
    parallel (``max_workers`` processes), each under ``run_tests``'s sandbox and limits.

    Args:
      prompts: [N] prompt strings (unused).
      completions: [N] completion strings.
      tests: [N] lists of assert statements.
      setup: [N] setup code strings (optional).

    Returns:
      [N] floats in [0, 1], or None where a sample has no tests.
    """
    del prompts
    setups = setup if setup is not None else [""] * len(completions)

    def score(args) -> float | None:
        completion, sample_tests, sample_setup = args
        if not sample_tests:
            return None
        code = extract_code(completion if isinstance(completion, str) else str(completion))
        if code is None:
            return 0.0
        passed = run_tests(
            code, sample_tests, sample_setup or "", timeout=timeout, memory_mb=memory_mb
        )
        return sum(passed) / len(passed)

    jobs = list(zip(completions, tests, setups, strict=True))
    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(max_workers, len(jobs))))
    try:
        return list(pool.map(score, jobs))
    finally:
        # A call stopped by a limit (``rewards.limits``) drops the samples not yet started
        # rather than run them for nobody; those running end at their own timeout.
        pool.shutdown(wait=False, cancel_futures=True)
