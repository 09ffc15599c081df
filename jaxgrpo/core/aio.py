"""Awaiting users' ``async def`` functions (tools, an environment's ``get_reward``) from host code.

TRL's ``GRPOTrainer`` accepts async tools and an async ``get_reward`` and awaits them on one event
loop that runs on a daemon thread; so does jaxgrpo. The loop is started on first use (no import
side effect) and lives as long as the process, so an environment may keep loop-bound state (an
HTTP client) across calls. ``gather`` hands it a batch of coroutines, which run concurrently,
each under its own wall-time limit (``asyncio.timeout``: no signal is involved, so the limit
holds whichever thread waits, main or not). The waiting thread waits in short slices, so that a
limit of ``rewards.limits`` on it (which, off the main thread, lands only between bytecodes) ends
the wait; the coroutines are then cancelled.

What no limit can stop: a coroutine that blocks the loop without awaiting (``time.sleep``, a
busy loop). The caller stops waiting for it at its limit plus ``_GRACE_S`` and reports a timeout,
but the loop stays busy until it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

_GRACE_S = 1.0  # the caller's wait past the limit before it gives up on a blocked loop
_SLICE_S = 0.05  # the caller waits in slices this long, so that a limit can interrupt it
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


class LimitExceeded(TimeoutError):
    """A coroutine that ran past its ``timeout_s`` (told apart from a ``TimeoutError`` the
    coroutine raised itself)."""


def is_async_callable(fn: Callable) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def`` function or method, or an
    object whose ``__call__`` is one)."""
    call = type(fn).__call__ if not inspect.isroutine(fn) and callable(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for users' coroutines, running on a daemon thread."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=serve, name="jaxgrpo-async", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def gather(coroutines: Sequence[Awaitable], timeout_s: float = 0.0) -> list[Any]:
    """Runs ``coroutines`` concurrently on the loop; each one's value, or the exception it
    raised (``LimitExceeded`` past ``timeout_s``; <= 0: no limit), in order. Never raises for
    what a coroutine did."""
    if not coroutines:
        return []

    async def bounded(coroutine: Awaitable) -> Any:
        if timeout_s <= 0:
            return await coroutine
        try:
            async with asyncio.timeout(timeout_s) as limit:
                return await coroutine
        except TimeoutError:
            if limit.expired():  # the limit, not a TimeoutError of the coroutine's own
                raise LimitExceeded(f"no result within {timeout_s:g} s") from None
            raise

    async def run_all() -> list[Any]:
        return await asyncio.gather(*map(bounded, coroutines), return_exceptions=True)

    future = asyncio.run_coroutine_threadsafe(run_all(), event_loop())
    try:
        return _wait(future, timeout_s + _GRACE_S if timeout_s > 0 else None)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return [LimitExceeded(f"no result within {timeout_s:g} s")] * len(coroutines)
    except BaseException:  # this thread was interrupted (``rewards.limits``): they stop too
        future.cancel()
        raise


def _wait(future: concurrent.futures.Future, limit_s: float | None) -> Any:
    """``future.result(limit_s)``, waited for in slices of ``_SLICE_S``: an exception raised
    in this thread asynchronously (``rewards.limits.bounded`` off the main thread) lands only
    between bytecodes, never inside one long wait."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while True:
        left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
        try:
            return future.result(max(left, 0.0))
        except concurrent.futures.TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def resolve(value: Any, timeout_s: float = 0.0) -> Any:
    """``value``, awaited first when it is awaitable (what an ``async def`` returned); an
    exception the coroutine raised is raised here."""
    if not inspect.isawaitable(value):
        return value
    (out,) = gather([value], timeout_s)
    if isinstance(out, BaseException):
        raise out
    return out
