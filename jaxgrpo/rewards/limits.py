"""Limits on one reward or tool call: time and memory, on any thread.

A reward function (or a tool) is the user's Python: one that never returns, spins or allocates
without end would hold the run forever. ``bounded`` runs a call on the calling thread while a
watchdog thread measures the call's wall time and the process's resident memory; past a limit
it interrupts the calling thread with ``RewardLimitExceeded``:

* on the main thread, with a signal whose handler raises it, so functions that use signals
  themselves (math-verify's ``signal.alarm``) keep working, and a call blocked in a sleep, a
  read or a lock wakes up (the interpreter runs handlers before it retries such a call);
* on any other thread (the producer thread of asynchronous rollouts), by raising it in that
  thread asynchronously (``PyThreadState_SetAsyncExc``). The interpreter looks for such an
  exception only between bytecodes, so a thread blocked in C code (``time.sleep``, a socket
  read, a lock) takes it only once that call returns.

``bounded_call`` is what callers use. On the main thread it is ``bounded`` around the call; on
another thread the call runs on a thread of its own under ``bounded`` while the caller waits,
and a call that a limit has not stopped ``_GRACE_S`` after it fired (blocked in C code) is left
behind: the caller gets ``RewardLimitExceeded`` and goes on, while the watchdog keeps
interrupting the call, which ends as soon as it runs Python again. Either way the caller scores
the call as failed (None) and the run goes on.

The watchdog interrupts again every ``_RESEND_S`` while the call swallows the exception. It is
disarmed under a lock when the call ends, and an exception it sent that has not landed yet is
withdrawn, so that none lands after ``bounded`` returns.

What cannot be stopped: a call stuck in C code that never returns to the interpreter (a
deadlock, an endless loop inside an extension). On the main thread it holds the run; on another
one its thread is left behind, with whatever memory it holds. math-verify and the code sandbox
bound their own C-level work (a worker process each).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from jaxgrpo.core.host import release_freed_memory

T = TypeVar("T")
# The signal the watchdog interrupts the main thread with; its handler is installed only for
# the duration of a bounded call and the previous one restored after.
_SIGNAL = signal.SIGUSR1
_POLL_S = 0.05
_RESEND_S = 1.0  # a call that swallowed the exception is interrupted again this often
# Off the main thread: how long past a limit the caller waits for the call to stop before it
# leaves the call behind (one in Python code stops within the interpreter's switch interval).
_GRACE_S = 0.5
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RewardLimitExceeded(BaseException):
    """Raised inside a reward call past its time or memory limit.

    A ``BaseException`` (like ``KeyboardInterrupt``), so a function's own ``except Exception``
    does not swallow it.
    """


class _Interrupt(RewardLimitExceeded):
    """The ``RewardLimitExceeded`` raised in another thread: the interpreter is given its class
    and makes it there with no arguments, so each watchdog's subclass sets ``why``, the
    message."""

    why = ""

    def __init__(self, *args: object):
        super().__init__(*(args or (self.why,)))


def _raise_in(thread_ident: int, exc_type: type[BaseException] | None) -> None:
    """Has ``exc_type`` raised in the thread at its next bytecode; None withdraws one sent
    that has not landed yet."""
    # Plain None passes NULL, which withdraws; py_object(None) would send None itself.
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), exc)


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class _Watchdog(threading.Thread):
    """Polls the call's wall time and memory growth; past a limit, interrupts the thread that
    made it (a signal for the main thread, an asynchronous exception for any other) and sets
    ``fired``.

    Made, armed and released by the thread that runs the call; ``release`` may be interrupted
    by an exception sent just before it, so its caller retries until ``released``.
    """

    def __init__(self, seconds: float, max_memory_gb: float, fired: threading.Event):
        super().__init__(name="reward-watchdog", daemon=True)
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.max_growth = int(max_memory_gb * (1 << 30)) if max_memory_gb > 0 else None
        self.start_rss = resident_bytes() if self.max_growth else 0
        self.target = threading.get_ident()
        self.by_signal = threading.current_thread() is threading.main_thread()
        self.lock = threading.Lock()  # sending and disarming never overlap
        self.armed = True
        self.released = False
        self.why: str | None = None
        self.stop_type: type[_Interrupt] | None = None
        self.fired = fired
        self.stopped = threading.Event()
        self.previous: object = None  # the signal's handler before ours (main thread)

    def arm(self) -> None:
        """Starts watching (on the main thread, with the signal's handler installed)."""
        if self.by_signal:
            self.previous = signal.signal(_SIGNAL, self._handle)
        self.start()

    def _handle(self, signum, frame) -> None:
        if self.armed and self.why is not None:
            raise RewardLimitExceeded(self.why)
        if callable(self.previous):  # not the watchdog's: whoever handled it before still does
            self.previous(signum, frame)

    def run(self) -> None:
        while not self.stopped.wait(_POLL_S):
            if self.why is None:
                self.why = self._breach()
                if self.why is None:
                    continue
                self.stop_type = type("RewardLimitExceeded", (_Interrupt,), {"why": self.why})
                self.fired.set()
            elif self.stopped.wait(_RESEND_S):
                return
            with self.lock:
                if not self.armed:
                    return
                if self.by_signal:
                    signal.pthread_kill(self.target, _SIGNAL)
                else:
                    _raise_in(self.target, self.stop_type)

    def release(self) -> None:
        """Disarms and stops the watchdog; nothing it sent lands after this returns (one sent
        that has not landed is withdrawn), and the signal's handler is restored."""
        with self.lock:
            self.armed = False
            if not self.by_signal and self.why is not None:
                _raise_in(self.target, None)
        self.stopped.set()
        self.join()
        if self.by_signal:
            signal.signal(_SIGNAL, self.previous)
        if self.why is not None and self.max_growth:
            release_freed_memory()  # what the interrupted call allocated goes back
        self.released = True

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
    body, on whichever thread runs it; off the main thread, a body blocked in C code takes it
    only once that returns (``bounded_call`` does not wait for it). None lands after the
    ``with``: one sent as the body ends fails it if it lands first, else it is dropped.

    Args:
      seconds: wall-time limit; <= 0: none (and no memory limit either).
      max_memory_gb: limit on the growth of the process's resident memory during the body,
        in GiB; <= 0: none.
    """
    if seconds <= 0:
        yield
        return
    dog = _Watchdog(seconds, max_memory_gb, threading.Event())
    dog.arm()
    try:
        yield
    finally:
        # Retried here, not inside release: entering a function is a point one can land at.
        while not dog.released:
            try:
                dog.release()
            except RewardLimitExceeded:
                pass  # sent just before the release: the body is over


class _Call(threading.Thread):
    """``fn()`` under ``bounded``'s limits on a thread of its own, which its caller may leave
    behind."""

    def __init__(self, fn: Callable[[], Any], seconds: float, max_memory_gb: float):
        # Named as its caller: the call runs on its behalf (logs, per-thread owners).
        super().__init__(name=threading.current_thread().name, daemon=True)
        self.fn, self.seconds, self.max_memory_gb = fn, seconds, max_memory_gb
        self.context = contextvars.copy_context()  # the caller's, as a call in place sees
        self.wake = threading.Event()  # the call ended or a limit fired
        self.done = threading.Event()
        self.dog: _Watchdog | None = None
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        # As ``bounded``, written out: contextlib's exit is Python code an interrupt could
        # land in before the release.
        self.dog = dog = _Watchdog(self.seconds, self.max_memory_gb, self.wake)
        dog.arm()
        try:
            self.value = self.context.run(self.fn)
        except BaseException as error:  # handed to the caller
            self.error = error
        finally:
            while not dog.released:
                try:
                    dog.release()
                except RewardLimitExceeded:
                    pass  # sent just before the release: the call is over
            self.done.set()
            self.wake.set()

    def result(self) -> Any:
        """The call's value, or what it raised; ``RewardLimitExceeded`` for one left behind."""
        while not self.wake.wait(_POLL_S):  # in slices: an interrupt of this thread lands
            pass
        if not self.done.wait(_GRACE_S):
            raise RewardLimitExceeded(self.dog.why)
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.value


def bounded_call(fn: Callable[[], T], seconds: float, max_memory_gb: float = 0.0) -> T:
    """``fn()`` under ``bounded``'s limits, from any thread.

    On the main thread (or with ``seconds <= 0``) it is ``fn()`` inside ``bounded``. On another
    thread ``fn`` runs on a thread of its own under ``bounded`` while this one waits, so that a
    call blocked in C code (a sleep, a read without a timeout), which no asynchronous exception
    reaches until it returns, holds the caller for no longer than its limit and ``_GRACE_S``;
    it is then left behind and stops when it next runs Python. ``fn`` sees the caller's
    ``contextvars``.

    Raises:
      RewardLimitExceeded: past a limit (the message says which).
      BaseException: what ``fn`` raised.
    """
    if seconds <= 0 or threading.current_thread() is threading.main_thread():
        with bounded(seconds, max_memory_gb):
            return fn()
    call = _Call(fn, seconds, max_memory_gb)
    call.start()
    return call.result()
