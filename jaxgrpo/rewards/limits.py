"""Limits on one reward call: time and memory.

A reward function is the user's Python: one that never returns, spins or allocates without end
would hold the run forever. ``bounded`` runs a call on the calling (main) thread, so functions
that use signals themselves (math-verify's ``signal.alarm``) keep working, while a watchdog
thread measures the call's wall time and the process's resident memory; past a limit it
interrupts the main thread with a signal whose handler raises ``RewardLimitExceeded``. The
caller then scores the call's samples as failed (None) and the run goes on.

What cannot be stopped this way: a call stuck inside C code that never returns to the
interpreter (a signal handler runs only between bytecodes). math-verify and the code sandbox
bound their own C-level work (a worker process each).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from jaxgrpo.core.host import release_freed_memory

# The signal the watchdog interrupts the main thread with; its handler is installed only for
# the duration of a bounded call and the previous one restored after.
_SIGNAL = signal.SIGUSR1
_POLL_S = 0.05
_RESEND_S = 1.0  # a call that swallowed the exception is interrupted again this often
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RewardLimitExceeded(BaseException):
    """Raised inside a reward call past its time or memory limit.

    A ``BaseException`` (like ``KeyboardInterrupt``), so a function's own ``except Exception``
    does not swallow it.
    """


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class _Watchdog(threading.Thread):
    """Polls the call's wall time and memory growth; past a limit, signals the main thread."""

    def __init__(self, seconds: float, max_growth: int | None):
        super().__init__(name="reward-watchdog", daemon=True)
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.max_growth = max_growth
        self.start_rss = resident_bytes() if max_growth else 0
        self.armed = True
        self.why: str | None = None
        self.stopped = threading.Event()
        self.target = threading.main_thread().ident

    def run(self) -> None:
        while not self.stopped.wait(_POLL_S):
            if self.why is None:
                self.why = self._breach()
                if self.why is None:
                    continue
            elif self.stopped.wait(_RESEND_S):
                return
            if self.armed:
                signal.pthread_kill(self.target, _SIGNAL)

    def _breach(self) -> str | None:
        if time.monotonic() > self.deadline:
            return f"took longer than {self.seconds:g} s (rewards.timeout_s)"
        if self.max_growth and resident_bytes() - self.start_rss > self.max_growth:
            gib = self.max_growth / (1 << 30)
            return f"grew the process's memory by more than {gib:g} GiB (rewards.max_memory_gb)"
        return None


@contextlib.contextmanager
def bounded(seconds: float, max_memory_gb: float = 0.0) -> Iterator[None]:
    """Runs the ``with`` body under a wall-time limit and a limit on resident-memory growth.

    Past either, ``RewardLimitExceeded`` (its message says which limit) is raised inside the
    body. Off the main thread, or with ``seconds <= 0``, the body runs unbounded (only the main
    thread can be interrupted by a signal handler).

    Args:
      seconds: wall-time limit; <= 0: none.
      max_memory_gb: limit on the growth of the process's resident memory during the body,
        in GiB; <= 0: none.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    growth = int(max_memory_gb * (1 << 30)) if max_memory_gb > 0 else None
    dog = _Watchdog(seconds, growth)

    def interrupt(signum, frame):
        if dog.armed and dog.why is not None:
            raise RewardLimitExceeded(dog.why)
        if callable(previous):  # not the watchdog's: whoever handled it before still does
            previous(signum, frame)

    previous = signal.signal(_SIGNAL, interrupt)
    dog.start()
    try:
        yield
    finally:
        dog.armed = False
        dog.stopped.set()
        dog.join()
        signal.signal(_SIGNAL, previous)
        if dog.why is not None and growth:
            release_freed_memory()  # what the interrupted call allocated goes back
