"""``SamplerSettings``: how the sampler samples, one value built once by its caller and passed
whole through ``generate`` / ``generate_from_state`` / ``sampler_programs``.

Its static fields choose the compiled programs (``LoopConfig``: length, samples, stop tokens,
top-k, the repetition guard's n, compaction and cache sizes); the others become the traced
``Knobs`` (temperature, top-p, min-p, per-row lengths, the repetition guard's count, padding),
so changing them between calls compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxgrpo.core.shapes import Array


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

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **fields: Any) -> SamplerSettings:
        """Settings that stop at ``tokenizer``'s stop tokens and pad with its pad id."""
        return cls(eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id, **fields)

    @classmethod
    def from_config(cls, sampling: Any, tokenizer: Any, *, num_samples: int) -> SamplerSettings:
        """A run's rollouts: its ``SamplingConfig`` (``sampling``, read by field: the config
        lies above the sampler), the tokenizer's stop and pad ids, G = ``num_samples``. The
        temperature is the schedule's start; a step replaces it with its own."""
        n, k = sampling.repetition_guard
        return cls.for_tokenizer(
            tokenizer,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            num_samples=num_samples,
            repetition_ngram=n,
            repetition_count=k,
        )
