"""``SamplerSettings``: how the sampler samples, one value built once by its caller and passed
whole through ``generate`` / ``generate_from_state`` / ``sampler_programs``.

Its static fields choose the compiled programs (``LoopConfig``: length, samples, stop tokens,
top-k, the repetition guard's n, compaction and cache sizes); the others become the traced
``Knobs`` (temperature, top-p, min-p, per-row lengths, the repetition guard's count, padding),
so changing them between calls compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from jaxgrpo.core.shapes import Array
from jaxgrpo.sampling.stop_strings import StopTables, check_stop_strings, token_bytes


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """The settings of one ``generate`` call.

    Attributes:
      max_new_tokens: T, tokens per completion (static).
      temperature: scalar, [T] or [R, T] (or [R, 1]); <= 0 is greedy (traced).
      top_p: nucleus mass, 1 = off (traced).
      top_k: keep the k most likely tokens, 0 = off (static).
      min_p: drop tokens below min_p times the most likely one's probability, 0 = off
        (traced).
      eos_ids: stop tokens (static).
      num_samples: G, completions per prompt (static).
      max_lengths: per-row cap, scalar, [B] or [R] (traced); None = T.
      repetition_ngram: stop a row whose tail is one block of at most n tokens repeated
        ``repetition_count`` times; 0 = off (static).
      repetition_count: k of that guard (traced; the sampler holds it at >= 2).
      pad_id: token after a row's stop.
      cache_dtype: the KV cache's dtype; None = the model's compute dtype.
      compact_rows: once at most M rows run, decode only those (static M, or decreasing
        (M1, M2, ...)); None = ``auto_compact_rows``, 0 or () = off.
      cache_sizes: increasing completion-cache sizes ending at T, grown through as tokens are
        written (static); None = ``auto_cache_sizes``, () = T slots from the start.
        The completions are the same whatever ``compact_rows`` and ``cache_sizes``.
      keep_cache: return the KV cache (``SampleOutput.cache``) for a later turn of an
        episode to continue from (static).
      stop_strings: a row stops at the token whose text completes one of these (the token
        kept); () = none. Set through ``for_tokenizer``, which builds ``stop``.
      stop: the strings' per-token tables (``StopTables``, traced: other strings of the same
        count and length compile nothing new), or None.
    """

    max_new_tokens: int
    temperature: float | Array = 1.0
    top_p: float | Array = 1.0
    top_k: int = 0
    min_p: float | Array = 0.0
    eos_ids: Sequence[int] = ()
    num_samples: int = 1
    max_lengths: int | Array | None = None
    repetition_ngram: int = 0
    repetition_count: int = 4
    pad_id: int = 0
    cache_dtype: str | None = None
    compact_rows: int | Sequence[int] | None = None
    cache_sizes: Sequence[int] | None = None
    keep_cache: bool = False
    stop_strings: tuple[str, ...] = ()
    stop: StopTables | None = None

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, *, stop_strings: Sequence[str] = (), **fields: Any
    ) -> SamplerSettings:
        """Settings that stop at ``tokenizer``'s stop tokens and ``stop_strings``, and pad with
        its pad id."""
        strings = tuple(dict.fromkeys(stop_strings))
        return cls(
            eos_ids=tuple(tokenizer.eos_ids),
            pad_id=tokenizer.pad_id,
            stop_strings=strings,
            stop=stop_tables(tokenizer, strings) if strings else None,
            **fields,
        )

    def with_stop_strings(self, tokenizer: Any, strings: Sequence[str]) -> SamplerSettings:
        """These settings stopping at ``strings`` too (a tool format's closing tags)."""
        merged = tuple(dict.fromkeys((*self.stop_strings, *strings)))
        if merged == self.stop_strings:
            return self
        return dataclasses.replace(
            self, stop_strings=merged, stop=stop_tables(tokenizer, merged) if merged else None
        )

    @classmethod
    def from_config(
        cls, sampling: Any, tokenizer: Any, *, num_samples: int, stop_strings: Sequence[str] = ()
    ) -> SamplerSettings:
        """A run's rollouts: its ``SamplingConfig`` (``sampling``, read by field: the config
        lies above the sampler), the tokenizer's stop and pad ids, ``sampling.stop`` and
        ``stop_strings`` (a tool format's), G = ``num_samples``. The temperature is the
        schedule's start; a step replaces it with its own."""
        n, k = sampling.repetition_guard
        return cls.for_tokenizer(
            tokenizer,
            stop_strings=(*getattr(sampling, "stop", ()), *stop_strings),
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            num_samples=num_samples,
            repetition_ngram=n,
            repetition_count=k,
        )


@functools.lru_cache(maxsize=8)
def stop_tables(tokenizer: Any, strings: tuple[str, ...]) -> StopTables:
    """``StopTables`` of ``strings`` over ``tokenizer``'s vocabulary, built once per pair."""
    return StopTables.build(check_stop_strings(strings), token_bytes(tokenizer.hf))
