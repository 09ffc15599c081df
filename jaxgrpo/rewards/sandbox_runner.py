"""The trusted half of the code sandbox, run as ``python -I -S sandbox_runner.py``.

It runs inside the child process, before and around the generated code: it reads a JSON spec
from stdin, locks its resource limits (soft = hard), installs an irremovable audit hook, then
runs the code in one of two modes, reporting on its original stdout (fd 1):

- ``tests`` (the ``code_tests`` reward): executes the setup, the program and each test,
  reporting one ``<nonce> <index> <0|1>`` line per test. The code's stdout/stderr go to
  ``/dev/null``.
- ``run`` (the agents' ``python`` tool): executes the program with its stdout on the file the
  parent passed as fd 2 (line-buffered, so a killed program's lines survive), its stderr on
  ``/dev/null``, and reports ``done`` or ``raised <last traceback line>``. Its output goes back
  to the model, so reads are confined too: files and directory listings outside the working
  directory and the standard library are refused.

Standard library only: the child runs without site-packages. Importing this module does nothing.
"""

import json
import os
import resource
import sys
import traceback

BLOCKED_EVENTS = frozenset(
    {
        "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
        "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "resource.setrlimit",
        "resource.prlimit", "os.chdir", "os.chroot", "sys.setprofile", "sys.settrace",
        "mmap.__new__", "cpython.PyInterpreterState_New",
    }
)  # fmt: skip
"""Audit events refused outright: process creation, signals, sockets, heap walking, limits, and
subinterpreters (an audit hook added from Python guards only its own interpreter)."""

WRITE_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
    "os.truncate": ((0, None),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
    "os.chflags": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),), "shutil.move": ((0, None), (1, None)),
    "shutil.copyfile": ((1, None),),
}  # fmt: skip
"""Audit events that write: ``event -> ((path index, dir_fd index or None), ...)`` in the
event's arguments, one pair per path the event writes (a hard link's source counts)."""

BLOCKED_MODULES = frozenset(
    {
        "ctypes", "_ctypes", "_posixsubprocess", "cffi", "_multiprocessing",
        "_xxsubinterpreters", "_testcapi", "_testinternalcapi", "_posixshmem", "readline",
        "spwd",
    }
)  # fmt: skip
"""Modules refused at import: raw memory, processes, subinterpreters, shared memory outside the
directory, and file or password access in C that raises no audit event (``readline``'s history
files, ``spwd``'s shadow passwords)."""
LIST_EVENTS = ("os.listdir", "os.scandir")  # confined with reads (a None path is the cwd)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_audit_hook(root: str, read_roots=None):
    """An audit hook refusing ``BLOCKED_*``, any write that resolves outside ``root`` and, with
    ``read_roots`` (a list of directories), any read or listing outside ``root`` and them."""
    realpath, join, readlink, isdir = os.path.realpath, os.path.join, os.readlink, os.path.isdir
    root = realpath(root) + os.sep
    readable_roots = None
    if read_roots is not None:
        readable_roots = (root, *(realpath(r) + os.sep for r in read_roots))

    def resolve(path, dir_fd=None):
        if isinstance(path, int):  # an fd: where it points
            return readlink(f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if dir_fd not in (None, -1):
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path, dir_fd=None, roots=root):
        try:
            return (resolve(path, dir_fd) + os.sep).startswith(roots)
        except (OSError, TypeError, ValueError):
            return False

    def readable(path):
        return readable_roots is None or inside(path, roots=readable_roots)

    def check_open(path, mode, flags):
        if isinstance(path, int):
            return  # already open; opening it was checked
        writes = any(c in mode for c in "wax+") if mode is not None else flags & _WRITE_FLAGS
        if writes and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory")
        if not readable(path):
            raise PermissionError("sandbox: reading outside the working directory")
        # A directory fd from os.open would let a later ``dir_fd=`` call escape unseen.
        if mode is None and not inside(path) and isdir(path):
            raise PermissionError("sandbox: opening a directory outside the working directory")

    def in_memory_or_inside(database):
        # SQLite opens its file in C, unaudited; a "file:" URI would be read as a local name.
        try:
            name = os.fsdecode(database)
        except TypeError:
            return False
        return name == ":memory:" or (not name.startswith("file:") and inside(name))

    def hook(event, args):
        if event in BLOCKED_EVENTS or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in BLOCKED_MODULES:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")
        if event == "open":
            check_open(*args)
        elif event in LIST_EVENTS and not readable("." if args[0] is None else args[0]):
            raise PermissionError(f"sandbox: {event} outside the working directory")
        elif event == "sqlite3.connect" and not in_memory_or_inside(args[0]):
            raise PermissionError("sandbox: a database outside the working directory")
        elif event in WRITE_EVENTS:
            for path_at, fd_at in WRITE_EVENTS[event]:
                if not inside(args[path_at], None if fd_at is None else args[fd_at]):
                    raise PermissionError(f"sandbox: {event} outside the working directory")

    return hook


def run(code: str, setup: str, tests: list, report) -> None:
    """Executes setup + code, then each test in the same namespace; ``report(i, ok)`` each."""
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(setup + "\n" + code, "<solution>", "exec"), namespace)
        loaded = True
    except BaseException:  # SystemExit from the generated code fails it like any error
        loaded = False
    for i, test in enumerate(tests):
        ok = False
        if loaded:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                ok = True
            except BaseException:
                ok = False
        report(i, ok)


def run_printing(code: str, report) -> None:
    """Executes ``code``, which prints to ``sys.stdout``, then reports ``done`` or ``raised
    <its traceback's last line>`` (``sys.exit()`` and ``sys.exit(0)`` are done)."""
    stdout, format_exception_only = sys.stdout, traceback.format_exception_only
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
        outcome = "done"
    except SystemExit as e:
        outcome = "done" if e.code in (None, 0) else f"raised SystemExit: {e.code}"
    except BaseException as e:
        outcome = "raised " + format_exception_only(type(e), e)[-1].rstrip("\n")
    try:
        stdout.flush()
    except BaseException:  # past RLIMIT_FSIZE: what was written stays
        pass
    report(outcome)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    os.close(0)
    results = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    printing = spec["mode"] == "run"
    os.dup2(2 if printing else devnull, 1)
    os.dup2(devnull, 2)
    for name, value in spec["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if printing:
        code, write = spec["code"], results.write
        del spec
        sys.stdout.reconfigure(line_buffering=True)
        sys.addaudithook(make_audit_hook(os.getcwd(), read_roots=list(sys.path)))
        run_printing(code, lambda outcome: write(outcome + "\n"))
        os._exit(0)
    # Bound before the code runs, so patching builtins or modules cannot change the report.
    write, prefixes = results.write, [f"{spec['nonce']} {i} " for i in range(len(spec["tests"]))]
    code, setup, tests = spec["code"], spec["setup"], spec["tests"]
    del spec
    sys.addaudithook(make_audit_hook(os.getcwd()))
    run(code, setup, tests, lambda i, ok: write(prefixes[i] + ("1\n" if ok is True else "0\n")))
    os._exit(0)


if __name__ == "__main__":
    main()
