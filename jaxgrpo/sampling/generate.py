"""``generate``: the sampling loop of ``loop.py`` wired to a ``Transformer`` and its ``KVCache``.

Two programs are compiled per shape bucket (B, P, T) and static settings: ``prefill`` (the
prompts once through the scanned layers, their cache split per layer and kept once per prompt as
the shared prompt part of a ``LayerKVCache``, token 0)
and ``decode`` (the per-layer decode weights prepared once, the completion cache made, then the
``while_loop``s: one per completion-cache size, the cache grown between them, then one per
compaction level; the loop state is updated in place). Both take the model state as a pure
pytree; the ``graphdef`` is closed over (never passed as data) and the jitted pair is cached per
(graphdef, model config, static settings), so a second call with the same shapes compiles
nothing, whatever the temperature, top-p or min-p.

An episode's later turn runs ``jaxgrpo.sampling.resume`` in place of ``prefill``.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo.core import sharding
from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.core.sharding import shard_act
from jaxgrpo.models.kv_cache import LayerKVCache, init_cache
from jaxgrpo.sampling.loop import ROW_FIELDS, Knobs, LoopConfig, SamplingState, decode, prefill
from jaxgrpo.sampling.settings import SamplerSettings


@flax.struct.dataclass
class SampleOutput:
    """Completions for R = B * G rows (prompt b -> rows b*G .. b*G+G-1).

    Attributes:
      tokens: int32 [R, T]; ``pad_id`` after the stopping token.
      logprobs: float32 [R, T]; log-prob of each token under the temperature-scaled,
        untruncated distribution (T = 1 for greedy positions); 0 where masked.
      mask: int32 [R, T]; 1 up to and including the stopping token.
      lengths: int32 [R]; ``mask.sum(1)``.
      stop_reason: int32 [R]; ``StopReason`` values.
      temperatures: float32 [R, T]; the temperature each position was sampled at.
      steps: int32 scalar; positions actually decoded (< T after an early exit).
      cache: with ``SamplerSettings.keep_cache``, every row's ``LayerKVCache`` after its
        completion, which ``resume_from_state`` continues; else None.
    """

    tokens: Array
    logprobs: Array
    mask: Array
    lengths: Array
    stop_reason: Array
    temperatures: Array
    steps: Array
    cache: Any = None


def _prefill_step_fn(graphdef: nnx.GraphDef, slots: int = 0):
    """``(states, ids_BP, mask_BP, cache) -> (last logits_BV, LayerKVCache)``: the prompts.

    The prompt pass scans the stacked layers into a ``KVCache`` of P slots (one pass, compiled
    once per layer), which becomes the shared prompt part of the per-layer decode cache. Its
    completion part has ``slots`` slots, none by default: the decode program makes them, so
    the empty cache is not an output held beside the decode program's own copy while it runs.
    """

    def step_fn(states, ids_BT, mask_BT, cache):
        model = nnx.merge(graphdef, *states)
        h_BTD, cache = model.prefill(ids_BT, mask_BT, cache)
        # Only the last position is needed: never build [B, P, V] logits for the prompt.
        cache = LayerKVCache.from_prompt(cache, slots, stacked=model.scans_decode)
        return model.logits(h_BTD[:, -1:, :])[:, 0, :], cache

    return step_fn


def _decode_step_fn(model: nnx.Module):
    """``(_, ids_R1, mask_R1, cache) -> (logits_RV, cache)``: one token through the layers.

    The decode-layout weights (LoRA folded in) are prepared here, before the ``while_loop``,
    so each step reads them in place; the unused first argument is the loop's ``params`` slot.
    """
    layers = model.decode_layers()

    ctx = model.shard_ctx

    def step_fn(_, ids_BT, mask_BT, cache):
        # The sampled tokens arrive split as the logits were (`_whole_vocabulary`); the layers
        # take them, and give back the cache, in the rows' layout of the rules.
        ids_BT, mask_BT = (shard_act(x, ("act_batch", None), ctx) for x in (ids_BT, mask_BT))
        h_BTD, cache = model.decode_step(ids_BT, mask_BT, cache, layers)
        logits_BV = _whole_vocabulary(model.logits(h_BTD[:, -1:, :])[:, 0, :], ctx)
        return logits_BV, cache if ctx is None else cache.constrain(ctx)

    return step_fn


def _whole_vocabulary(logits_RV: Array, ctx: sharding.ShardingCtx | None) -> Array:
    """The logits split by rows over as many mesh axes as divide them, each row's vocabulary
    whole: one all-to-all per token, after which sampling (top-p's threshold search, min-p,
    the draw) needs no collective, where on the LM head's vocabulary-split layout every
    reduction over the vocabulary is one, and top-p gathers the rows' whole logits."""
    if ctx is None:
        return logits_RV
    axes, split = [], 1
    for axis in sharding.MESH_AXES:
        size = ctx.mesh.shape[axis]
        if size > 1 and logits_RV.shape[0] % (split * size) == 0:
            axes.append(axis)
            split *= size
    spec = PartitionSpec(tuple(axes) or None, None)
    return jax.lax.with_sharding_constraint(logits_RV, NamedSharding(ctx.mesh, spec))


def _sampling_model(graphdef: nnx.GraphDef, states, model_cfg) -> nnx.Module:
    """The model the decode loop runs, its weights resharded once to the sampling rules.

    The prefill runs on the training layout (one pass, like a training forward). Before the
    decode loop the weights move to ``sharding.sampling_rules`` (replicated over data x fsdp
    when they fit, else split over fsdp x tensor), so the loop body's only collectives are
    the tensor-parallel all-reduces;
    the resharded copy lives only while this program runs.
    """
    model = nnx.merge(graphdef, *states)
    ctx = model.shard_ctx
    if ctx is None:
        return model
    itemsize = jnp.dtype(model_cfg.dtype).itemsize
    weight_bytes = sum(x.size * itemsize for x in jax.tree.leaves(states))
    rules = sharding.sampling_rules(ctx.mesh, weight_bytes)
    if rules == ctx.rules:
        return model
    shardings = [sharding.param_shardings(s, ctx.mesh, rules) for s in states]
    states = jax.tree.map(jax.lax.with_sharding_constraint, tuple(states), tuple(shardings))
    model = nnx.merge(graphdef, *states)
    model.shard_ctx = sharding.ShardingCtx(ctx.mesh, rules)
    return model


def _rows_to(state: SamplingState, ctx: sharding.ShardingCtx | None) -> SamplingState:
    """The loop state laid out by ``ctx``'s rules once, before the loop: rows (and the cache)
    move when the sampling rules split them differently from the training rules (over data
    only under ``SAMPLE_TP_RULES``), so the loop's carry keeps one layout at every token."""
    if ctx is None:
        return state
    rows = lambda x: shard_act(x, ("act_batch",) + (None,) * (x.ndim - 1), ctx)  # noqa: E731
    return state.replace(
        cache=state.cache.constrain(ctx), **{f: rows(getattr(state, f)) for f in ROW_FIELDS}
    )


@functools.lru_cache(maxsize=32)
def programs(graphdef: nnx.GraphDef, model_cfg, cfg: LoopConfig, cache_dtype: str):
    """Jitted (prefill, decode) pair for one model structure and static loop settings.

    ``prefill(states, ids_BP, mask_BP, knobs, rng) -> SamplingState`` (its cache: the prompt
    part, no completion slots) and ``decode(states, state, knobs) -> SamplingState`` (no
    cache); public so that benchmarks can time the two programs separately.
    """

    def prefill_fn(states, ids_BP, mask_BP, knobs, rng) -> SamplingState:
        batch, prompt_len = ids_BP.shape
        ctx = nnx.merge(graphdef, *states).shard_ctx
        cache = init_cache(model_cfg, batch, prompt_len, cache_dtype).constrain(ctx)
        step_fn = _prefill_step_fn(graphdef, cfg.completion_slots)
        state = prefill(step_fn, states, ids_BP, mask_BP, cache, knobs, rng, cfg)
        return state.replace(cache=state.cache.constrain(ctx))

    def decode_fn(states, state, knobs) -> SamplingState:
        model = _sampling_model(graphdef, states, model_cfg)
        if state.cache.mask.shape[1] < cfg.first_cache_size:  # a prompt's: no slots yet
            state = state.replace(cache=state.cache.grow(cfg.first_cache_size))
        state = _rows_to(state, model.shard_ctx)
        state = decode(_decode_step_fn(model), None, state, knobs, cfg)
        # Only a later turn needs the cache: as an output its full-size buffers are allocated
        # for the whole program, beside the smaller sizes the first loops run with.
        return state if cfg.keep_cache else state.replace(cache=None)

    return jax.jit(prefill_fn), jax.jit(decode_fn)


def compiled_programs() -> int:
    """Total number of programs compiled so far by ``generate`` (for recompilation tests)."""
    total = 0
    for key in _cached_keys:
        prefill_jit, decode_jit = programs(*key)
        total += prefill_jit._cache_size() + decode_jit._cache_size()
    return total


_cached_keys: set = set()


def make_knobs(
    n: int,
    max_new_tokens: int,
    *,
    temperature,
    top_p=1.0,
    min_p=0.0,
    max_lengths=None,
    repetition_count: int = 4,
    pad_id: int = 0,
    stop=None,
) -> Knobs:
    """Builds the traced settings with fixed dtypes and shapes, so values never recompile.

    ``temperature`` may be a scalar, a [T] per-position array, or [R, T] (or [R, 1]) per row.
    ``max_lengths`` may be None (= T), a scalar, or an [R] array. ``stop``: the stop strings'
    ``StopTables`` or None.
    """
    t = max_new_tokens
    temperature_RT = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (n, t))
    max_len = t if max_lengths is None else max_lengths
    max_len_R = jnp.clip(jnp.broadcast_to(jnp.asarray(max_len, jnp.int32), (n,)), 1, t)
    return Knobs(
        temperature_RT=temperature_RT,
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
        max_len_R=max_len_R,
        repetition_count=jnp.asarray(max(repetition_count, 2), jnp.int32),
        pad_id=jnp.asarray(pad_id, jnp.int32),
        stop=stop,
    )


def auto_compact_rows(
    n: int, rows_can_stop_early: bool, devices: int | None = None, max_new_tokens: int = 0
) -> tuple[int, ...]:
    """The default ``compact_rows``: R / 4 rows, then one row per device, once R >= 16, when
    rows can stop before the end; with budgets longer than ``CACHE_STEP`` tokens R / 2 first.

    A GRPO batch's completions have a long tail (format_copy: mean 11 of 32 tokens, but most
    batches have a row that runs to 32), so most decode steps would run finished rows. Each
    level compiles another copy of the decode loop; a step's cost falls with its rows, so the
    last straggler runs alone (figures: benchmarks/README.md, "Compaction levels"). With long
    budgets completions spread over hundreds of steps (gsm8k at 512 tokens: half the rows stop
    by about token 260, a quarter run past 450), so the R / 2 level's steps outweigh its
    compilation. The compacted rows must still split evenly over the ``devices`` the rows are
    sharded over (default: every device).
    """
    if not rows_can_stop_early or n < 16:
        return ()
    devices = devices or jax.device_count()
    levels = {n // 4, devices} | ({n // 2} if max_new_tokens > CACHE_STEP else set())
    return tuple(m for m in sorted(levels, reverse=True) if 0 < m < n and m % devices == 0)


CACHE_STEP = 128  # completion-cache sizes of the decode loop: multiples of this
APPEND = 16  # ids one resume pass appends to a row's cache (``jaxgrpo.sampling.resume``)


def earlier_width(max_new_tokens: int) -> int:
    """Completion slots of an episode's later-turn cache for its ids before the turn's last
    resume pass (fewer than ``max_new_tokens``: that pass holds at least the turn's last kept
    id), moved there by each pass: one value per budget, one cache shape per run."""
    return -(-(max_new_tokens - 1) // APPEND) * APPEND


def episode_slots(max_new_tokens: int) -> int:
    """Completion slots of an episode's cache from its later turns on: the earlier ids, a
    resume pass's ``APPEND``, then the turn's ``max_new_tokens`` to sample."""
    return earlier_width(max_new_tokens) + APPEND + max_new_tokens


def auto_cache_sizes(max_new_tokens: int) -> tuple[int, ...]:
    """The default ``cache_sizes``: multiples of ``CACHE_STEP`` up to T, then T.

    A decode step reads the completion cache's every slot, so a cache of T slots makes the
    first tokens as slow as the last; growing it by ``CACHE_STEP`` keeps each step's
    attention within ``CACHE_STEP`` slots of what has been written (at T = 512: 62.5% of the
    slots read with one size). Each size compiles another copy of the first decode loop, so
    completions of at most ``CACHE_STEP`` tokens keep one size.
    """
    if max_new_tokens <= CACHE_STEP:
        return ()
    return tuple(range(CACHE_STEP, max_new_tokens, CACHE_STEP)) + (max_new_tokens,)


def _compact_levels(compact_rows: int | Sequence[int]) -> tuple[int, ...]:
    levels = tuple(compact_rows) if isinstance(compact_rows, Sequence) else (compact_rows,)
    levels = tuple(int(m) for m in levels if m)
    if any(m < 0 for m in levels) or list(levels) != sorted(set(levels), reverse=True):
        raise ValueError(f"compact_rows={compact_rows!r}: want decreasing positive row counts")
    return levels


def _devices_of(x) -> int | None:
    """Devices a sharded (possibly abstract) array spans; None (= every device) for one."""
    sharding = getattr(x, "sharding", None)
    count = len(sharding.device_set) if sharding is not None else 1
    return count if count > 1 else None


def _loop_config(settings: SamplerSettings, n: int, devices: int | None) -> LoopConfig:
    """The static part of ``settings`` for ``n`` rows split over ``devices``, the defaults of
    ``compact_rows`` and ``cache_sizes`` resolved."""
    s, t = settings, int(settings.max_new_tokens)
    compact_rows = s.compact_rows
    if compact_rows is None:
        can_stop_early = (
            bool(s.eos_ids)
            or bool(s.repetition_ngram)
            or s.max_lengths is not None
            or s.stop is not None
        )
        compact_rows = auto_compact_rows(n, can_stop_early, devices, t)
    cache_sizes = auto_cache_sizes(t) if s.cache_sizes is None else tuple(s.cache_sizes)
    # An episode's turn of one sample per prompt: a later turn's, or a first turn laid out as
    # one (its prompt rows are its rows), so that both run one decode program.
    episode = bool(s.keep_cache) and int(s.num_samples) == 1
    return LoopConfig(
        max_new_tokens=t,
        num_samples=int(s.num_samples),
        eos_ids=tuple(int(e) for e in s.eos_ids),
        top_k=int(s.top_k),
        repetition_ngram=int(s.repetition_ngram),
        compact_rows=_compact_levels(compact_rows),
        cache_sizes=() if episode else cache_sizes,
        keep_cache=bool(s.keep_cache),
        completion_slots=episode_slots(t) if episode else 0,
    )


def sampler_programs(
    graphdef: nnx.GraphDef, model_cfg, prompt_ids: Array, settings: SamplerSettings
) -> tuple[Callable, Callable, Knobs]:
    """The jitted ``(prefill, decode)`` of a ``generate_from_state`` call, and its knobs.

    ``generate_from_state`` runs them; ``jaxgrpo.planning.compile`` lowers them with abstract inputs
    (``prompt_ids`` may be a sharded ``jax.ShapeDtypeStruct``). Arguments are
    ``generate_from_state``'s.
    """
    n = prompt_ids.shape[0] * int(settings.num_samples)
    cfg = _loop_config(settings, n, _devices_of(prompt_ids))
    cache_dtype = settings.cache_dtype or getattr(model_cfg, "dtype", "float32")
    key = (graphdef, model_cfg, cfg, cache_dtype)
    _cached_keys.add(key)
    prefill_jit, decode_jit = programs(*key)
    max_lengths = settings.max_lengths
    if max_lengths is not None and jnp.ndim(max_lengths) == 1 and cfg.num_samples > 1:
        if jnp.shape(max_lengths)[0] != n:
            max_lengths = jnp.repeat(jnp.asarray(max_lengths), cfg.num_samples)
    knobs = make_knobs(
        n,
        cfg.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        min_p=settings.min_p,
        max_lengths=max_lengths,
        repetition_count=settings.repetition_count,
        pad_id=settings.pad_id,
        stop=settings.stop,
    )
    return prefill_jit, decode_jit, knobs


def generate_from_state(
    graphdef: nnx.GraphDef,
    states: Sequence[PyTree],
    model_cfg,
    prompt_ids: Array,
    prompt_mask: Array,
    settings: SamplerSettings,
    *,
    rng: Array,
) -> SampleOutput:
    """``generate`` for a split model: ``nnx.merge(graphdef, *states)`` is the model.

    The trainer calls this with ``states = (base, lora)`` so nothing is re-split per step.
    Arguments are those of ``generate``, ``settings`` whole.
    """
    prefill_jit, decode_jit, knobs = sampler_programs(graphdef, model_cfg, prompt_ids, settings)
    ids = jnp.asarray(prompt_ids, jnp.int32)
    mask = jnp.asarray(prompt_mask, jnp.int32)
    state = prefill_jit(tuple(states), ids, mask, knobs, rng)
    return _output(decode_jit(tuple(states), state, knobs), knobs)


def _output(state: SamplingState, knobs: Knobs) -> SampleOutput:
    return SampleOutput(
        tokens=state.tokens_RT,
        logprobs=state.logprobs_RT,
        mask=state.mask_RT,
        lengths=state.lengths_R,
        stop_reason=state.stop_reason_R,
        temperatures=knobs.temperature_RT,
        steps=state.step,
        cache=state.cache,
    )


def generate(
    model: nnx.Module,
    prompt_ids: Array,
    prompt_mask: Array,
    settings: SamplerSettings | None = None,
    *,
    rng: Array,
    **fields,
) -> SampleOutput:
    """Samples ``num_samples`` completions per prompt with a KV cache.

    Args:
      model: a ``jaxgrpo.models.transformer.Transformer`` (any module with ``prefill``,
        ``decode_step``, ``decode_layers`` and ``logits`` and a ``cfg`` accepted by ``init_cache``).
      prompt_ids: int32 [B, P] left-padded prompts (P is the bucket length).
      prompt_mask: int32 [B, P], 1 on prompt tokens.
      settings: how to sample (``SamplerSettings``); None = its defaults.
      rng: PRNG key.
      **fields: ``SamplerSettings`` fields replacing those of ``settings``
        (``max_new_tokens=32, num_samples=8``...).

    Returns:
      ``SampleOutput`` with R = B * G rows.
    """
    if settings is None:
        settings = SamplerSettings(**fields)
    elif fields:
        settings = dataclasses.replace(settings, **fields)
    graphdef, state = nnx.split(model)
    return generate_from_state(
        graphdef, (state,), model.cfg, prompt_ids, prompt_mask, settings, rng=rng
    )
