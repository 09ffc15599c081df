"""An episode's later turn from the KV cache the turn before kept (``SamplerSettings.keep_cache``):
``resume`` takes the calling rows' cache, drops the ids sampled past each turn's cut, and runs
only the appended ids (a tool's result) through the layers, in place of ``prefill``; the
``decode`` program of ``jaxgrpo.sampling.generate`` goes on from there. The prompt and the
episode so far are never computed again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.sampling.generate import (
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
    knobs, rng, width, room) -> SamplingState``: a later turn of an episode from the kept
    cache of the turn before (``LayerKVCache.resume``: rows ``rows_N``, each one's slots
    before ``valid_until_N`` moved into ``width`` slots), the appended ids [N, K] (left-padded)
    through the decode layers in one pass, and token 0 sampled; ``decode`` goes on from it.
    Only the appended ids are computed again, not the prompt and the episode so far. The
    cache gets ``room`` (>= K) slots for the appended ids whatever K, so the decode program
    and the next turn's ``resume`` have one shape for every result width."""

    def resume_fn(
        states, cache, rows_N, valid_until_N, next_pos_N, ids_NK, mask_NK, knobs, rng, width,
        room,
    ):  # fmt: skip
        model = _sampling_model(graphdef, states, model_cfg)
        new_slots = max(room, ids_NK.shape[1]) + cfg.max_new_tokens
        cache = cache.resume(rows_N, valid_until_N, next_pos_N, width, new_slots)
        state = prefill(_decode_step_fn(model), None, ids_NK, mask_NK, cache, knobs, rng, cfg)
        return _rows_to(state, model.shard_ctx)

    return jax.jit(resume_fn, static_argnames=("width", "room"))


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
    rows: Array,
    valid_until: Array,
    next_pos: Array,
    ids: Array,
    mask: Array,
    width: int,
    settings: SamplerSettings,
    *,
    rng: Array,
    room: int = 0,
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
      ids / mask: int32 [N, K], the appended ids, left-padded.
      width: completion slots that hold every row's kept ones (static).
      settings: as ``generate_from_state``'s (``resume_settings`` applied); ``max_lengths``
        [N] is each row's remaining budget.
      rng: this turn's key.
      room: cache slots for the appended ids (static; at least K, which 0 means): one value
        for every turn of a run keeps the later turns' programs to one shape.

    Returns:
      ``SampleOutput`` of N rows; the i-th appended id and the sampled token j sit at
      completion slots ``width + i`` and ``width + K + j`` of its cache.
    """
    ids = jnp.asarray(ids, jnp.int32)
    resume_jit, decode_jit, knobs = resume_programs(graphdef, model_cfg, ids, settings)
    as_int = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    state = resume_jit(
        tuple(states), cache, as_int(rows), as_int(valid_until), as_int(next_pos), ids,
        as_int(mask), knobs, rng, width=width, room=room,
    )  # fmt: skip
    return _output(decode_jit(tuple(states), state, knobs), knobs)
