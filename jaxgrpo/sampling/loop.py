"""The model-free sampling loop: prefill once, then a ``lax.while_loop`` of one-token steps.

The loop only knows a ``step_fn(params, ids_BT, mask_BT, cache) -> (logits_BV, cache)`` callable
(flax lm1b's ``tokens_to_logits`` idea): it returns the logits of the *last* position of
``ids_BT`` and the updated cache. Any pytree works as a cache as long as it has a
``repeat(G)`` method that repeats each batch row G times (``LayerKVCache.repeat``), and
``take(rows)`` / ``grow(size)`` when rows are compacted or the cache grows. Tests drive the
loop with a fake step function; ``jaxgrpo.sampling.generate`` plugs in the Transformer.

Flow for B prompts and G samples each (R = B * G rows, prompt b -> rows b*G .. b*G+G-1):

1. ``prefill``: one ``step_fn`` call over the left-padded prompts [B, P], so each prompt is
   processed once; its cache and last logits are then repeated to the R rows and token 0 is
   sampled.
2. ``decode``: while ``step < T`` and some row is still running, feed token ``step - 1`` of
   every row, sample token ``step``, record it. Finished rows keep computing (static shapes)
   but their outputs are masked.

Randomness is ``fold_in(rng, step)``, so a run is reproducible whatever the early exit.
"""

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.sampling.select import select_tokens
from jaxgrpo.sampling.stop_strings import StopTables

StepFn = Callable[[PyTree, Array, Array, Any], tuple[Array, Any]]


class StopReason(enum.IntEnum):
    """Why a row stopped; stored in ``stop_reason`` as int32."""

    LENGTH = 0  # reached max_new_tokens or its own per-row maximum length
    STOP_TOKEN = 1  # emitted one of the stop (eos) tokens; it is included in the mask
    REPETITION = 2  # its tail became a block of <= n tokens repeated k times (repetition guard)
    STOP_STRING = 3  # its text completed a stop string; the completing token is in the mask


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static loop settings: changing any of them compiles a new program.

    Attributes:
      max_new_tokens: T, number of completion slots.
      num_samples: G, samples drawn per prompt.
      eos_ids: token ids that stop a row.
      top_k: keep only the k most likely tokens (0 = off).
      repetition_ngram: repetition guard's longest block length n (0 = guard off).
      compact_rows: decreasing row counts M1 > M2 > ...; once at most M1 rows are still
        running, the loop goes on with just M1 rows (the running ones), then with M2 once at
        most M2 run, and so on, so finished rows stop costing compute. Needs a cache with
        ``take(rows)``; () = off. The result is the same either way: row r draws the same
        random numbers wherever it sits in the batch.
      cache_sizes: increasing completion-cache sizes ending at ``max_new_tokens``: the cache
        starts with the first, and the first loop (all rows) runs while the tokens it has
        cached fit, then grows the cache to the next size (``cache.grow(size)``) and goes on,
        so a step attends the slots written so far rounded up to a size, not all T. Loops
        after a compaction keep the cache at its full size. () = T slots from the start. The
        result is the same either way.
      keep_cache: the final state keeps the cache of every row (compacted rows written back
        with ``cache.put(rows, sub)``), for a later turn of an episode to continue from.
      completion_slots: the completion slots a prompt's cache gets up front (0 = the
        decode makes them, ``cache_sizes``): an episode's one-sample-per-prompt first turn
        gets its later turns' layout (``generate.episode_slots``), so that both run one
        decode program.
    """

    max_new_tokens: int
    num_samples: int = 1
    eos_ids: tuple[int, ...] = ()
    top_k: int = 0
    repetition_ngram: int = 0
    compact_rows: tuple[int, ...] = ()
    cache_sizes: tuple[int, ...] = ()
    keep_cache: bool = False
    completion_slots: int = 0

    def __post_init__(self):
        sizes = self.cache_sizes
        if sizes and (list(sizes) != sorted(set(sizes)) or sizes[0] < 1):
            raise ValueError(f"cache_sizes={sizes!r}: want increasing positive sizes")
        if sizes and sizes[-1] != self.max_new_tokens:
            raise ValueError(f"cache_sizes={sizes!r} must end at max_new_tokens")

    @property
    def first_cache_size(self) -> int:
        """The completion slots the cache starts with."""
        return self.cache_sizes[0] if self.cache_sizes else self.max_new_tokens


@flax.struct.dataclass
class Knobs:
    """Traced sampling settings: new values never recompile.

    Attributes:
      temperature_RT: float32 [R, T]; temperature for each row and completion position
        (<= 0 means greedy at that position).
      top_p: float32 scalar nucleus mass (1 = off).
      min_p: float32 scalar min-p ratio (0 = off).
      max_len_R: int32 [R]; per-row maximum number of new tokens (<= T).
      repetition_count: int32 scalar k of the repetition guard.
      pad_id: int32 scalar written into ``tokens`` after a row stopped.
      stop: the stop strings' tables (``StopTables``), or None without stop strings.
    """

    temperature_RT: Array
    top_p: Array
    min_p: Array
    max_len_R: Array
    repetition_count: Array
    pad_id: Array
    stop: StopTables | None = None


@flax.struct.dataclass
class SamplingState:
    """Loop carry of the decode ``while_loop``s, from prefill to decode.

    Attributes:
      step: int32 scalar; index of the next completion position to sample.
      tokens_RT: int32 [R, T]; sampled tokens, ``pad_id`` after a row stopped.
      logprobs_RT: float32 [R, T]; log-probability of each token under the temperature-scaled,
        untruncated distribution; 0 where masked.
      mask_RT: int32 [R, T]; 1 up to and including the stopping token.
      lengths_R: int32 [R]; number of unmasked tokens.
      done_R: bool [R]; the row has stopped.
      stop_reason_R: int32 [R]; a ``StopReason`` (LENGTH until something else stops the row).
      repeat_run_RQ: int32 [R, Q] with Q = max(repetition_ngram, 1); for each block length
        q = 1..Q, how many consecutive recent tokens equal the token q positions earlier.
      partial_RSL: bool [R, S, L]; each row's match state of the stop strings
        (``StopTables``); [R, 1, 1] without stop strings.
      cache: the step function's cache pytree, R rows.
      rng: PRNG key of the whole call; step keys are ``fold_in(rng, step)``.
    """

    step: Array
    tokens_RT: Array
    logprobs_RT: Array
    mask_RT: Array
    lengths_R: Array
    done_R: Array
    stop_reason_R: Array
    repeat_run_RQ: Array
    partial_RSL: Array
    cache: Any
    rng: Array


def _repetition_runs(state: SamplingState, token_R: Array, active_R: Array) -> Array:
    """Updates the per-block-length runs of ``token == token r positions back``."""
    num_q = state.repeat_run_RQ.shape[1]
    back_Q = jnp.arange(1, num_q + 1, dtype=jnp.int32)
    pos_Q = state.step - back_Q
    n = state.tokens_RT.shape[0]
    prev_RQ = jnp.take(state.tokens_RT, jnp.clip(pos_Q, 0), axis=1)
    same_RQ = (prev_RQ == token_R[:, None]) & jnp.broadcast_to(pos_Q >= 0, (n, num_q))
    runs_RQ = jnp.where(same_RQ, state.repeat_run_RQ + 1, 0)
    return jnp.where(active_R[:, None], runs_RQ, state.repeat_run_RQ)


def _record(
    state: SamplingState, token_R: Array, logprob_R: Array, knobs: Knobs, cfg: LoopConfig
) -> SamplingState:
    """Writes the token sampled at ``state.step`` and updates stop bookkeeping."""
    active_R = ~state.done_R
    step = state.step
    token_R = jnp.where(active_R, token_R, knobs.pad_id)
    logprob_R = jnp.where(active_R, logprob_R, 0.0)
    lengths_R = state.lengths_R + active_R.astype(jnp.int32)

    stop_tok_R = jnp.isin(token_R, jnp.asarray(cfg.eos_ids, jnp.int32)) & active_R
    repeat_run_RQ = state.repeat_run_RQ
    stop_rep_R = jnp.zeros_like(active_R)
    if cfg.repetition_ngram > 0:
        repeat_run_RQ = _repetition_runs(state, token_R, active_R)
        # A block of length r repeated k times means r * (k - 1) consecutive matches.
        block_Q = jnp.arange(1, cfg.repetition_ngram + 1, dtype=jnp.int32)
        need_Q = block_Q * (knobs.repetition_count - 1)
        hit_RQ = repeat_run_RQ >= jnp.broadcast_to(need_Q, repeat_run_RQ.shape)
        stop_rep_R = jnp.any(hit_RQ, axis=1) & active_R & ~stop_tok_R
    partial_RSL = state.partial_RSL
    stop_str_R = jnp.zeros_like(active_R)
    if knobs.stop is not None:
        after_RSL, hit_R = knobs.stop.advance(partial_RSL, token_R)
        partial_RSL = jnp.where(active_R[:, None, None], after_RSL, partial_RSL)
        stop_str_R = hit_R & active_R & ~stop_tok_R
        stop_rep_R &= ~stop_str_R
    stop_len_R = active_R & (lengths_R >= knobs.max_len_R)

    reason_R = jnp.where(stop_rep_R, StopReason.REPETITION, state.stop_reason_R)
    reason_R = jnp.where(stop_str_R, StopReason.STOP_STRING, reason_R)
    reason_R = jnp.where(stop_tok_R, StopReason.STOP_TOKEN, reason_R).astype(jnp.int32)
    column = (0, step)
    return state.replace(
        step=step + 1,
        tokens_RT=jax.lax.dynamic_update_slice(state.tokens_RT, token_R[:, None], column),
        logprobs_RT=jax.lax.dynamic_update_slice(state.logprobs_RT, logprob_R[:, None], column),
        mask_RT=jax.lax.dynamic_update_slice(
            state.mask_RT, active_R[:, None].astype(jnp.int32), column
        ),
        lengths_R=lengths_R,
        done_R=state.done_R | stop_tok_R | stop_rep_R | stop_str_R | stop_len_R,
        stop_reason_R=reason_R,
        repeat_run_RQ=repeat_run_RQ,
        partial_RSL=partial_RSL,
    )


def _sample_and_record(
    state: SamplingState,
    logits_RV: Array,
    knobs: Knobs,
    cfg: LoopConfig,
    rows_R: Array | None = None,
    num_rows: int | None = None,
) -> SamplingState:
    """Samples token ``state.step`` for every row from ``logits_RV`` and records it.

    ``rows_R`` / ``num_rows``: after compaction, the rows' places in the full batch.
    """
    temperature_R = jax.lax.dynamic_index_in_dim(
        knobs.temperature_RT, state.step, axis=1, keepdims=False
    )
    token_R, logprob_R = select_tokens(
        jax.random.fold_in(state.rng, state.step),
        logits_RV,
        temperature_R,
        knobs.top_p,
        knobs.min_p,
        top_k=cfg.top_k,
        rows_R=rows_R,
        num_rows=num_rows,
    )
    return _record(state, token_R, logprob_R, knobs, cfg)


def prefill(
    step_fn: StepFn,
    params: PyTree,
    prompt_ids_BP: Array,
    prompt_mask_BP: Array,
    cache: Any,
    knobs: Knobs,
    rng: Array,
    cfg: LoopConfig,
) -> SamplingState:
    """Runs the prompts once, repeats their cache to G rows each, and samples token 0.

    Args:
      step_fn: ``(params, ids_BT, mask_BT, cache) -> (last-position logits_BV, cache)``.
      params: the step function's parameters.
      prompt_ids_BP: int32 [B, P] left-padded prompts.
      prompt_mask_BP: int32 [B, P], 1 on real prompt tokens.
      cache: an empty cache for B rows with room for P + T tokens.
      knobs: traced settings for R = B * G rows.
      rng: PRNG key for the call.
      cfg: static loop settings.

    Returns:
      The loop state after token 0 (step = 1).
    """
    logits_BV, cache = step_fn(params, prompt_ids_BP, prompt_mask_BP, cache)
    g = cfg.num_samples
    if g > 1:
        logits_BV = jnp.repeat(logits_BV, g, axis=0)
        cache = cache.repeat(g)
    n, t = knobs.temperature_RT.shape
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens_RT=jnp.zeros((n, t), jnp.int32),
        logprobs_RT=jnp.zeros((n, t), jnp.float32),
        mask_RT=jnp.zeros((n, t), jnp.int32),
        lengths_R=jnp.zeros((n,), jnp.int32),
        done_R=jnp.zeros((n,), bool),
        stop_reason_R=jnp.full((n,), StopReason.LENGTH, jnp.int32),
        repeat_run_RQ=jnp.zeros((n, max(cfg.repetition_ngram, 1)), jnp.int32),
        partial_RSL=knobs.stop.start(n) if knobs.stop is not None else jnp.ones((n, 1, 1), bool),
        cache=cache,
        rng=rng,
    )
    return _sample_and_record(state, logits_BV, knobs, cfg)


ROW_FIELDS = (
    "tokens_RT",
    "logprobs_RT",
    "mask_RT",
    "lengths_R",
    "done_R",
    "stop_reason_R",
    "repeat_run_RQ",
    "partial_RSL",
)


def _take_rows(state: SamplingState, knobs: Knobs, rows_M: Array) -> tuple[SamplingState, Knobs]:
    """The loop state and knobs of rows ``rows_M`` only (the cache via ``cache.take``)."""
    take = lambda x: jnp.take(x, rows_M, axis=0)  # noqa: E731
    sub = state.replace(
        cache=state.cache.take(rows_M), **{f: take(getattr(state, f)) for f in ROW_FIELDS}
    )
    knobs = knobs.replace(
        temperature_RT=take(knobs.temperature_RT), max_len_R=take(knobs.max_len_R)
    )
    return sub, knobs


def _put_rows(
    state: SamplingState, rows_M: Array, sub: SamplingState, keep_cache: bool
) -> SamplingState:
    """Writes the rows decoded by ``sub`` back; the cache too with ``keep_cache``, else it
    stays the one before compaction."""
    put = {f: getattr(state, f).at[rows_M].set(getattr(sub, f)) for f in ROW_FIELDS}
    cache = state.cache.put(rows_M, sub.cache) if keep_cache else state.cache
    return state.replace(step=sub.step, cache=cache, **put)


def decode(
    step_fn: StepFn, params: PyTree, state: SamplingState, knobs: Knobs, cfg: LoopConfig
) -> SamplingState:
    """Samples tokens ``state.step .. T-1``, exiting as soon as every row has stopped.

    With ``cfg.compact_rows = (M, ...)``, the loop over all R rows stops once at most M rows
    are running; M rows, all the running ones and then finished ones, in row order, are
    gathered (``cache.take``) and a second loop decodes them, compacting again at the next
    count, and so on. The returned state holds every row's tokens; its cache is then the
    R-row cache as it was at the first compaction, or with ``cfg.keep_cache`` every row's
    to its end. With ``cfg.cache_sizes``, the loop over all rows is one loop per cache size,
    the cache grown between them.

    Args:
      step_fn: as in ``prefill``; called on [R, 1] token batches.
      params: the step function's parameters.
      state: the state returned by ``prefill``.
      knobs: traced settings.
      cfg: static loop settings.

    Returns:
      The final state; ``step`` is the number of positions actually sampled.
    """
    n, t = state.tokens_RT.shape

    def run(s: SamplingState, kn: Knobs, rows_M: Array | None, until: int, end: int = t):
        """Decodes while step < end and more than `until` rows run."""

        def cond(s: SamplingState) -> Array:
            return (s.step < end) & (jnp.sum(~s.done_R) > until)

        def body(s: SamplingState) -> SamplingState:
            last_R1 = jax.lax.dynamic_slice_in_dim(s.tokens_RT, s.step - 1, 1, axis=1)
            logits_RV, cache = step_fn(params, last_R1, jnp.ones_like(last_R1), s.cache)
            return _sample_and_record(s.replace(cache=cache), logits_RV, kn, cfg, rows_M, n)

        return jax.lax.while_loop(cond, body, s)

    def growing(s: SamplingState, kn: Knobs, until: int) -> SamplingState:
        """`run` over every row through each cache size: step s caches token s - 1 at slot
        s - 1, so a cache of `size` slots serves the steps up to `size`."""
        sizes = cfg.cache_sizes
        for size, next_size in zip(sizes[:-1], sizes[1:], strict=True):
            s = run(s, kn, None, until, end=size + 1)
            s = s.replace(cache=s.cache.grow(next_size))
        return run(s, kn, None, until)

    def compacting(s: SamplingState, kn: Knobs, rows: Array | None, levels) -> SamplingState:
        """Decodes `s` (whose rows are `rows` of the full batch, None = all) to the end."""
        m = levels[0] if levels else 0
        if rows is None:
            loop = lambda s, until: growing(s, kn, until)  # noqa: E731
        else:
            loop = lambda s, until: run(s, kn, rows, until)  # noqa: E731
        if not 0 < m < s.done_R.shape[0]:
            return loop(s, 0)
        s = loop(s, m)
        # Running rows sort first (stable: in row order); keep M of them, in row order.
        pick_M = jnp.sort(jnp.argsort(s.done_R, stable=True)[:m]).astype(jnp.int32)
        sub, sub_knobs = _take_rows(s, kn, pick_M)
        rows_M = pick_M if rows is None else jnp.take(rows, pick_M)
        done = compacting(sub, sub_knobs, rows_M, levels[1:])
        return _put_rows(s, pick_M, done, cfg.keep_cache)

    return compacting(state, knobs, None, cfg.compact_rows)
