"""The trusted half of the ``code_tests`` sandbox, run as ``python -I -S sandbox_runner.py``.

It runs inside the child process, before and around the generated code: it reads a JSON spec
from stdin, locks its resource limits (soft = hard), installs an irremovable audit hook, then
executes the setup, the program and each test, reporting one ``<nonce> <index> <0|1>`` line per
test on its original stdout. The generated code's own stdout/stderr go to ``/dev/null``.

Standard library only: the child runs without site-packages. Importing this module does nothing.
"""

import json
import os
import resource
import sys

BLOCKED_EVENTS = frozenset(
    {
        "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
        "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "resource.setrlimit",
        "resource.prlimit", "os.chdir", "os.chroot", "sys.setprofile", "sys.settrace",
        "mmap.__new__",
    }
)  # fmt: skip
"""Audit events refused outright: process creation, signals, sockets, heap walking, limits."""

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

BLOCKED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "cffi", "_multiprocessing"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_audit_hook(root: str):
    """An audit hook refusing ``BLOCKED_*`` and any write that resolves outside ``root``."""
    root = os.path.realpath(root) + os.sep
    realpath, join, readlink, isdir = os.path.realpath, os.path.join, os.readlink, os.path.isdir

    def resolve(path, dir_fd=None):
        if isinstance(path, int):  # an fd: where it points
            return readlink(f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if dir_fd not in (None, -1):
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path, dir_fd=None):
        try:
            return (resolve(path, dir_fd) + os.sep).startswith(root)
        except (OSError, TypeError, ValueError):
            return False

    def check_open(path, mode, flags):
        if isinstance(path, int):
            return  # already open; opening it was checked
        writes = any(c in mode for c in "wax+") if mode is not None else flags & _WRITE_FLAGS
        if writes and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory")
        # A directory fd from os.open would let a later ``dir_fd=`` call escape unseen.
        if mode is None and not inside(path) and isdir(path):
            raise PermissionError("sandbox: opening a directory outside the working directory")

    def hook(event, args):
        if event in BLOCKED_EVENTS or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in BLOCKED_MODULES:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")
        if event == "open":
            check_open(*args)
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


def main() -> None:
    spec = json.loads(sys.stdin.read())
    os.close(0)
    results = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    for name, value in spec["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    # Bound before the code runs, so patching builtins or modules cannot change the report.
    write, prefixes = results.write, [f"{spec['nonce']} {i} " for i in range(len(spec["tests"]))]
    code, setup, tests = spec["code"], spec["setup"], spec["tests"]
    del spec
    sys.addaudithook(make_audit_hook(os.getcwd()))
    run(code, setup, tests, lambda i, ok: write(prefixes[i] + ("1\n" if ok is True else "0\n")))
    os._exit(0)


if __name__ == "__main__":
    main()
