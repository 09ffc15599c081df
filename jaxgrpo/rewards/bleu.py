"""Sentence BLEU between a completion's reasoning and the reference solution (sacrebleu)."""

from __future__ import annotations

import sacrebleu

from jaxgrpo.grading.answers import completion_text
from jaxgrpo.rewards.embedding import reasoning_text


def bleu(prompts: list[str], completions: list[str], *, reference: list, **_) -> list[float | None]:
    """``r_i = sacrebleu.sentence_bleu(reasoning_text(c_i), [ref_i]).score / 100`` in [0, 1].

    The hypothesis is the completion with its ``<answer>`` spans and think tags removed
    (``embedding.reasoning_text``), the same text the embedding and perplexity rewards score,
    so the ``embedding_bleu`` hybrid judges one thing; an empty reasoning scores 0. sacrebleu's
    defaults apply (13a tokenizer, exponential smoothing). A missing (None or empty) reference
    scores None.

    Args:
      prompts: [N] prompt strings (unused).
      completions: [N] completion strings.
      reference: [N] reference texts.

    Returns:
      [N] floats in [0, 1], or None where the reference is missing.
    """
    del prompts
    rewards: list[float | None] = []
    for completion, ref in zip(completions, reference, strict=True):
        if ref is None or not str(ref).strip():
            rewards.append(None)
            continue
        text = reasoning_text(completion_text(completion))
        score = sacrebleu.sentence_bleu(text, [str(ref)]).score if text else 0.0
        rewards.append(float(score) / 100.0)
    return rewards
