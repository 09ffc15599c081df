"""Hybrid rewards: fixed mixes of the embedding reward with BLEU or with the exact answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.embedding import embedding
from jaxgrpo.rewards.math import exact_answer

RewardFn = Callable[..., list]


def _mix(parts: Sequence[tuple[float, list]]) -> list[float | None]:
    out = []
    for values in zip(*(p for _, p in parts), strict=True):
        if any(v is None for v in values):
            out.append(None)
        else:
            out.append(sum(w * float(v) for (w, _), v in zip(parts, values, strict=True)))
    return out


def embedding_bleu(
    prompts: list[str],
    completions: list[str],
    *,
    reference: list,
    embedding_fn: RewardFn | None = None,
    **columns,
) -> list[float | None]:
    """The seed study's hybrid: ``r = 0.7 * cos + 0.3 * BLEU``.

    ``cos`` is the ``embedding`` reward (cosine of sentence embeddings of the reasoning and the
    reference) and ``BLEU`` the ``bleu`` reward in [0, 1]; None where either is None.
    ``embedding_fn`` replaces the default encoder reward (same signature).
    """
    cosine = (embedding_fn or embedding)(prompts, completions, reference=reference, **columns)
    return _mix([(0.7, cosine), (0.3, bleu(prompts, completions, reference=reference))])


def hard_soft(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list,
    reference: list,
    hard_weight: float = 0.5,
    embedding_fn: RewardFn | None = None,
    **columns,
) -> list[float | None]:
    """``r = hard_weight * exact_answer + (1 - hard_weight) * embedding``; None where either is.

    Pass ``hard_weight`` with ``get_reward("hard_soft", hard_weight=0.8)``.
    """
    hard = exact_answer(
        prompts, completions, answer=answer, model_completions=columns.get("model_completions")
    )
    soft = (embedding_fn or embedding)(prompts, completions, reference=reference, **columns)
    return _mix([(hard_weight, hard), (1.0 - hard_weight, soft)])
