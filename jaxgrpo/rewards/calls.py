"""How one reward function is called: ``call`` (all samples at once, then sample by sample
where that raised, so only the offending samples fail), ``acall`` for an ``async def`` one, and
``await_all``, which runs a step's ``async def`` functions together.

TRL's GRPOTrainer awaits coroutine reward functions (an LLM judge over HTTP, say) on an event
loop of their own, a daemon thread, with ``asyncio.gather``; jaxgrpo's one such loop is
``core.aio``'s, which tools and environments use too. ``rewards.timeout_s`` bounds each
function (on that loop, whichever thread waits); ``rewards.max_memory_gb`` bounds the group,
through ``limits.bounded`` around the wait (on any thread: the wait is in slices an interrupt
can land between). A function that blocks the loop without awaiting cannot be stopped: the wait
for it ends at its limit and it scores as timed out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from jaxgrpo.core import aio
from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded

is_async = aio.is_async_callable
_WATCH_BEYOND_S = 3.0  # the memory watchdog's deadline past timeout_s: aio's wait ends first


def await_all(
    coroutines: Mapping[str, Awaitable], timeout_s: float, max_memory_gb: float = 0.0
) -> dict[str, Any]:
    """Runs ``coroutines`` together; name -> its value, the exception it raised, or
    ``RewardLimitExceeded`` (why) when a limit stopped it.

    Args:
      coroutines: name -> a started ``acall``.
      timeout_s: wall time of each at most; <= 0: none.
      max_memory_gb: growth of the process while they run at most; <= 0: none.
    """
    names = list(coroutines)
    try:
        with bounded(timeout_s + _WATCH_BEYOND_S if timeout_s > 0 else 0.0, max_memory_gb):
            outs = aio.gather([coroutines[n] for n in names], timeout_s)
    except RewardLimitExceeded as stop:
        return {n: stop for n in names}
    too_long = f"took longer than {timeout_s:g} s (rewards.timeout_s)"
    return {
        n: RewardLimitExceeded(too_long) if isinstance(out, aio.LimitExceeded) else out
        for n, out in zip(names, outs, strict=True)
    }


def call(fn: Callable, prompts, completions, columns: Mapping, context: Mapping, per_sample: bool):
    """``fn``'s values for the batch and {index: error} of the samples that raised.

    Args:
      fn: the reward function, called by keyword (TRL's arguments).
      prompts / completions / columns: [N] each (columns: name -> [N] values).
      context: the arguments every call gets whole (``trainer_state``, the loggers).
      per_sample: when the batch call raises, call ``fn`` on each sample alone (a sample that
        raises scores None); False: the batch call's exception propagates.
    """
    try:
        return fn(prompts=prompts, completions=completions, **columns, **context), {}
    except Exception:
        if not per_sample:
            raise
    values, failed = [], {}
    for i in range(len(completions)):
        try:
            values.append(_single(fn(**_sample(i, prompts, completions, columns), **context)))
        except Exception as error:
            failed[i] = error
            values.append(None)
    return values, failed


async def acall(fn: Callable, prompts, completions, columns, context, per_sample: bool):
    """``call`` of an ``async def`` function."""
    try:
        return await fn(prompts=prompts, completions=completions, **columns, **context), {}
    except Exception:
        if not per_sample:
            raise
    values, failed = [], {}
    for i in range(len(completions)):
        try:
            one = _sample(i, prompts, completions, columns)
            values.append(_single(await fn(**one, **context)))
        except Exception as error:
            failed[i] = error
            values.append(None)
    return values, failed


def _sample(i: int, prompts, completions, columns: Mapping) -> dict:
    """The keyword arguments of sample ``i`` alone."""
    one = {k: [v[i]] for k, v in columns.items()}
    return {"prompts": [prompts[i]], "completions": [completions[i]], **one}


def _single(result) -> Any:
    """The one value of a call on one sample."""
    if len(result) != 1:
        raise ValueError(f"returned {len(result)} values for 1 completion")
    return result[0]
