"""An episode's later turn from the KV cache the turn before kept (``SamplerSettings.keep_cache``):
``resume`` takes the calling rows' cache, drops the ids sampled past each turn's cut, and runs
only the appended ids (a tool's result) through the layers, in place of ``prefill``; the
``decode`` program of ``jaxgrpo.sampling.generate`` goes on from there. The prompt and the
episode so far are never computed again.

The appended ids go through in passes of ``APPEND``: a longer result takes several passes of
the one program, each packing the row's slots again, so the cache keeps ``APPEND`` slots for
them whatever a result's length, and every later turn's decode attends as few. A first turn's
cache is laid out as the passes leave it once (``pack``), unless the turn had one sample per
prompt: the sampler then lays it out so from the start (``generate.episode_slots``), and that
turn runs the later turns' decode program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.sampling.generate import (
    APPEND,
    SampleOutput,
    _decode_step_fn,
    _devices_of,
    _loop_config,
    _output,
    _rows_to,
    _sampling_model,
    sampler_programs,
)
from jaxgrpo.sampling.loop import LoopConfig, prefill
from jaxgrpo.sampling.settings import SamplerSettings


@functools.lru_cache(maxsize=32)
def resume_program(graphdef: nnx.GraphDef, model_cfg, cfg: LoopConfig):
    """Jitted ``resume(states, cache, rows_N, valid_until_N, next_pos_N, ids_NK, mask_NK,
    knobs, rng, width) -> SamplingState``: rows ``rows_N`` of a kept cache
    (``LayerKVCache.resume``: each one's slots before ``valid_until_N`` moved into ``width``
    slots, then K + T empty ones), the appended ids [N, K] (left-padded) through the decode
    layers in one pass, and token 0 sampled; ``decode`` goes on from it. Its output cache is
    also its input for the next pass of a longer result: one program per cache shape."""

    def resume_fn(
        states, cache, rows_N, valid_until_N, next_pos_N, ids_NK, mask_NK, knobs, rng, width
    ):
        model = _sampling_model(graphdef, states, model_cfg)
        new_slots = ids_NK.shape[1] + cfg.max_new_tokens
        cache = cache.resume(rows_N, valid_until_N, next_pos_N, width, new_slots)
        state = prefill(_decode_step_fn(model), None, ids_NK, mask_NK, cache, knobs, rng, cfg)
        return _rows_to(state, model.shard_ctx)

    return jax.jit(resume_fn, static_argnames=("width",))


@functools.lru_cache(maxsize=32)
def pack_program(graphdef: nnx.GraphDef, model_cfg):
    """Jitted ``pack(states, cache, rows_N, valid_until_N, next_pos_N, width, slots) ->
    LayerKVCache``: a first turn's kept cache (one prompt row per group, its completion slots)
    in a later turn's layout, as ``resume`` leaves it (rows ``rows_N``, each with its prompt
    and its slots before ``valid_until_N`` in the last of ``width`` slots, then ``slots``
    empty ones), placed as ``resume`` places it. Data movement only: with it every resume pass
    of a run, from a first turn or a later one, runs the one ``resume`` program."""

    def pack_fn(states, cache, rows_N, valid_until_N, next_pos_N, width, slots):
        ctx = _sampling_model(graphdef, states, model_cfg).shard_ctx
        cache = cache.resume(rows_N, valid_until_N, next_pos_N, width, slots)
        return cache if ctx is None else cache.constrain(ctx)

    return jax.jit(pack_fn, static_argnames=("width", "slots"))


def resume_settings(settings: SamplerSettings) -> SamplerSettings:
    """``settings`` for a later turn: one sample per row, the cache allocated whole (its slots
    do not start at 0, so it is not grown step by step) and kept for the turn after."""
    return dataclasses.replace(settings, num_samples=1, cache_sizes=(), keep_cache=True)


def resume_programs(graphdef: nnx.GraphDef, model_cfg, ids: Array, settings: SamplerSettings):
    """The jitted ``(resume, decode)`` of a ``resume_from_state`` call with ``ids`` [N, K],
    and its knobs (``sampler_programs`` for a later turn)."""
    settings = resume_settings(settings)
    _, decode_jit, knobs = sampler_programs(graphdef, model_cfg, ids, settings)
    cfg = _loop_config(settings, ids.shape[0], _devices_of(ids))
    return resume_program(graphdef, model_cfg, cfg), decode_jit, knobs


def resume_from_state(
    graphdef: nnx.GraphDef,
    states: Sequence[PyTree],
    model_cfg,
    cache: Any,
    rows: np.ndarray,
    valid_until: np.ndarray,
    next_pos: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray,
    width: int,
    settings: SamplerSettings,
    *,
    rng: Array,
    put: Callable[[np.ndarray], Array] = jnp.asarray,
) -> SampleOutput:
    """A later turn of an episode for N rows of an earlier call's kept ``cache``
    (``SampleOutput.cache``), prefilling only the ids appended since (a tool's result).

    Args:
      graphdef / states / model_cfg: as ``generate_from_state``'s.
      cache: the earlier call's ``SampleOutput.cache``.
      rows: int32 [N], which of its rows go on.
      valid_until: int32 [N], each row's completion slots before this one hold its episode;
        later ones were sampled past the turn's cut and are dropped.
      next_pos: int32 [N], the position id of each row's first appended id.
      ids / mask: int32 [N, K], the appended ids, left-padded; K a multiple of ``APPEND``,
        one pass each.
      width: completion slots that hold every row's kept ones and all but its last
        ``APPEND`` appended ones (static).
      settings: as ``generate_from_state``'s (``resume_settings`` applied); ``max_lengths``
        [N] is each row's remaining budget.
      rng: this turn's key.
      put: places a host array [N, ...] on the devices (the rows split over the mesh), the
        same way for every pass, so that each runs the one program. The arguments above
        are host arrays.

    Returns:
      ``SampleOutput`` of N rows; the last pass's i-th id and the sampled token j sit at
      completion slots ``width + i`` and ``width + APPEND + j`` of its cache.
    """
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    n, k = ids.shape
    if k % APPEND or not k:
        raise ValueError(f"appended ids [{n}, {k}]: want a positive multiple of {APPEND} columns")
    place = lambda x: put(np.asarray(x, np.int32))  # noqa: E731
    states, next_pos = tuple(states), np.asarray(next_pos, np.int32)
    slots = APPEND + int(settings.max_new_tokens)
    if not _later_layout(cache, width + slots):  # a first turn's: packed once
        args = place(rows), place(valid_until), place(next_pos)
        pack = pack_program(graphdef, model_cfg)
        cache = pack(states, cache, *args, width=width, slots=slots)
        rows, valid_until = np.arange(n), np.full(n, width)
    resume_jit = decode_jit = knobs = state = None
    for start in range(0, k, APPEND):
        piece = slice(start, start + APPEND)
        if state is not None:  # a later pass: every row goes on from the pass before
            cache, rows, valid_until = state.cache, np.arange(n), np.full(n, width + APPEND)
        ids_NA = place(ids[:, piece])
        if resume_jit is None:
            resume_jit, decode_jit, knobs = resume_programs(graphdef, model_cfg, ids_NA, settings)
        state = resume_jit(
            states, cache, place(rows), place(valid_until), place(next_pos), ids_NA,
            place(mask[:, piece]), knobs, rng, width=width,
        )  # fmt: skip
        next_pos = next_pos + mask[:, piece].sum(1, dtype=np.int32)
    return _output(decode_jit(states, state, knobs), knobs)


def _later_layout(cache: Any, slots: int) -> bool:
    """Whether ``cache`` is laid out as a resume pass leaves it: a prompt row per row and
    ``slots`` completion slots."""
    return cache.prompt_mask.shape[0] == cache.mask.shape[0] and cache.mask.shape[1] == slots
