"""Length shaping: DAPO's soft overlong punishment (in tokens) and an n-gram repetition penalty."""

from __future__ import annotations

from jaxgrpo.grading.answers import completion_text


def _token_lengths(n: int, completion_ids, completion_lengths) -> list[int]:
    if completion_lengths is not None:
        lengths = [int(x) for x in completion_lengths]
    elif completion_ids is not None:
        lengths = [len(ids) for ids in completion_ids]
    else:
        raise ValueError(
            "length_penalty measures tokens: the caller must pass the column "
            "'completion_ids' (token id lists, as TRL does) or 'completion_lengths'"
        )
    if len(lengths) != n:
        raise ValueError(f"length_penalty got {len(lengths)} lengths for {n} completions")
    return lengths


def length_penalty(
    prompts: list[str],
    completions: list[str],
    *,
    max_length: int = 1024,
    cache_length: int = 256,
    completion_ids: list | None = None,
    completion_lengths: list | None = None,
    **_,
) -> list[float]:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), with ``L`` in tokens:

        r(L) = 0                                  if L <= L_max - L_cache
             = (L_max - L_cache - L) / L_cache    if L_max - L_cache < L <= L_max
             = -1                                 if L > L_max

    ``L_max = max_length`` should be the sampler's ``max_new_tokens``; ``L_cache =
    cache_length`` is the soft zone. Lengths come from ``completion_lengths`` ([N] ints) or
    ``completion_ids`` ([N] token lists, as TRL passes them); the trainer passes both. Pass
    the limits with ``get_reward("length_penalty", max_length=..., cache_length=...)``.

    Returns:
      [N] floats in [-1, 0].
    """
    del prompts
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    soft_start = max_length - cache_length
    rewards = []
    for length in _token_lengths(len(completions), completion_ids, completion_lengths):
        if length <= soft_start:
            rewards.append(0.0)
        elif length <= max_length:
            rewards.append((soft_start - length) / cache_length)
        else:
            rewards.append(-1.0)
    return rewards


def repetition_penalty(
    prompts: list[str], completions: list[str], *, ngram: int = 3, **_
) -> list[float]:
    """Penalty for repeated word n-grams: ``r = -(1 - unique / total)`` over the completion's
    whitespace-separated, lower-cased word n-grams (``ngram``, default 3).

    0 for text without repeated n-grams (or shorter than ``ngram`` words), approaching -1 for a
    loop of one phrase (``"a b c a b c ..."`` has ``unique = 3`` of ``total = W - 2``).

    Returns:
      [N] floats in (-1, 0].
    """
    del prompts
    rewards = []
    for completion in completions:
        words = completion_text(completion).lower().split()
        grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
        rewards.append(-(1.0 - len(set(grams)) / len(grams)) if grams else 0.0)
    return rewards
