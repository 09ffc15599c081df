"""Temperature schedules over training steps and, optionally, over completion positions.

A schedule is a pure function ``f(x) -> float32`` of a step count ``x`` (a Python number or a
traced array), like an optax schedule. The same kinds serve both axes:

* over training steps: ``x`` is the trainer's step, giving the base temperature of a rollout;
* over completion positions: ``x`` is the token index 0..T-1, giving a *multiplier* of the base
  temperature, so a completion can start hot and cool down.

``temperatures(step, T, schedule, position_schedule)`` combines them into the ``[T]`` array that
``generate`` takes. The trainer stores that array with the rollout so the loss scores every
token under the temperature it was sampled at.

Example::

    sched = linear(1.2, 0.7, steps=500)               # anneal over training
    per_pos = piecewise([16], [1.3, 1.0])             # hotter first 16 tokens
    temp_T = temperatures(step, 128, sched, per_pos)  # [128]
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxgrpo.core.shapes import Array

Schedule = Callable[[Array | float], Array]


def _progress(x: Array | float, begin: int, steps: int) -> Array:
    """Fraction of the way through ``[begin, begin + steps]``, clipped to [0, 1]."""
    return jnp.clip((jnp.asarray(x, jnp.float32) - begin) / max(steps, 1), 0.0, 1.0)


def constant(value: float) -> Schedule:
    """Always ``value``."""
    return lambda x: jnp.full(jnp.shape(x), value, jnp.float32)


def linear(init: float, end: float, steps: int, begin: int = 0) -> Schedule:
    """Goes linearly from ``init`` (at ``begin``) to ``end`` (at ``begin + steps``), then holds."""
    return lambda x: init + (end - init) * _progress(x, begin, steps)


def cosine(init: float, end: float, steps: int, begin: int = 0) -> Schedule:
    """Half-cosine from ``init`` to ``end`` over ``steps``, then holds ``end``."""

    def f(x):
        weight = 0.5 * (1.0 + jnp.cos(math.pi * _progress(x, begin, steps)))
        return end + (init - end) * weight

    return f


def exponential(init: float, end: float, steps: int, begin: int = 0) -> Schedule:
    """Geometric interpolation ``init * (end / init) ** progress``; both must be > 0."""
    if init <= 0 or end <= 0:
        raise ValueError(f"exponential schedule needs init > 0 and end > 0, got {init}, {end}")
    ratio = math.log(end / init)
    return lambda x: init * jnp.exp(ratio * _progress(x, begin, steps))


def piecewise(boundaries: Sequence[int], values: Sequence[float]) -> Schedule:
    """``values[i]`` for ``boundaries[i-1] <= x < boundaries[i]`` (``len(values) = len(b) + 1``)."""
    if len(values) != len(boundaries) + 1:
        raise ValueError(
            f"piecewise needs len(values) == len(boundaries) + 1, got {len(values)} values "
            f"for {len(boundaries)} boundaries"
        )
    if list(boundaries) != sorted(boundaries):
        raise ValueError(f"piecewise boundaries must be increasing, got {list(boundaries)}")
    bounds = jnp.asarray(boundaries, jnp.float32)
    vals = jnp.asarray(values, jnp.float32)

    def f(x):
        x = jnp.asarray(x, jnp.float32)[..., None]
        above = x >= jnp.broadcast_to(bounds, x.shape[:-1] + bounds.shape)
        return vals[jnp.sum(above, axis=-1)]

    return f


SCHEDULES = {
    "constant": constant,
    "linear": linear,
    "cosine": cosine,
    "exponential": exponential,
    "piecewise": piecewise,
}


def make_schedule(kind: str, **kwargs) -> Schedule:
    """Builds a schedule by name, for configs: ``make_schedule("cosine", init=1, end=0, steps=9)``.

    Raises:
      ValueError: unknown ``kind``, listing the known ones.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown temperature schedule {kind!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[kind](**kwargs)


def build(
    kind: str,
    *,
    init: float,
    end: float,
    steps: int,
    boundaries: Sequence[int] = (),
    values: Sequence[float] = (),
) -> Schedule:
    """The schedule a config describes: ``init`` -> ``end`` over ``steps`` for the smooth kinds,
    ``values`` between ``boundaries`` for ``piecewise``, ``init`` for ``constant``."""
    if kind == "constant":
        return constant(init)
    if kind == "piecewise":
        return piecewise(boundaries, values)
    return make_schedule(kind, init=init, end=end, steps=steps)


def temperatures(
    step: Array | int,
    num_tokens: int,
    schedule: Schedule | float,
    position_schedule: Schedule | None = None,
) -> Array:
    """The [T] temperature array for one rollout at training ``step``.

    Args:
      step: training step (int or traced int).
      num_tokens: T, the completion length.
      schedule: base temperature over training steps, or a constant float.
      position_schedule: optional multiplier over completion positions 0..T-1.

    Returns:
      float32 [T]: ``schedule(step) * position_schedule(t)``.
    """
    base = schedule(step) if callable(schedule) else jnp.asarray(schedule, jnp.float32)
    temp_T = jnp.broadcast_to(jnp.asarray(base, jnp.float32), (num_tokens,))
    if position_schedule is not None:
        temp_T = temp_T * position_schedule(jnp.arange(num_tokens, dtype=jnp.float32))
    return temp_T


def rollout_temperatures(sampling: Any, steps: int) -> tuple[Callable, Callable]:
    """(step -> the step's base temperature, a float; step -> a rollout's temperature: that
    float, or float32 [T] when a position schedule is set) of a run's sampling settings
    (``temperature``, ``temperature_schedule``, ``position_schedule``, ``max_new_tokens``: a
    ``SamplingConfig``) over a run of ``steps`` steps."""
    s, p, t = sampling.temperature_schedule, sampling.position_schedule, sampling.max_new_tokens
    per_step = build(
        s.kind, init=sampling.temperature, end=s.end, steps=s.steps or steps,
        boundaries=s.boundaries, values=s.levels,
    )  # fmt: skip

    def step_temperature(step: int) -> float:
        return float(per_step(step))

    if p.kind == "constant":
        return step_temperature, step_temperature
    per_position = build(
        p.kind, init=1.0, end=p.end, steps=p.steps or t, boundaries=p.boundaries, values=p.levels
    )
    return step_temperature, lambda step: np.asarray(temperatures(step, t, per_step, per_position))
