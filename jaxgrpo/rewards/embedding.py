"""Embedding-similarity reward: cosine between the completion's reasoning and the reference.

    r = cos(E(reasoning(completion)), E(reference))          in [-1, 1]

``E`` is a BERT sentence encoder (``jaxgrpo.models.encoder``; default all-MiniLM-L6-v2), mean
pooled and L2-normalised, so the cosine is a dot product. The reasoning is the completion with
every ``<answer>...</answer>`` span removed (an unclosed ``<answer>`` drops the rest of the text)
and ``<think>``/``<reasoning>`` tag markup stripped: the reward scores how the model reasons,
while the final answer is left to ``exact_answer``. MiniLM truncates at 256 tokens, so only the
first ~200 words of each side count.

Edge cases: a missing reference (``None``) scores ``None`` ("cannot score"); an empty
reasoning (e.g. a bare ``<answer>42</answer>``) scores 0.0, not the similarity of an empty
string.
"""

from __future__ import annotations

import functools
import re

import numpy as np

_ANSWER_SPAN = re.compile(r"<answer>.*?(?:</answer>|\Z)", re.DOTALL | re.IGNORECASE)
_MARKUP = re.compile(r"</?(?:think|reasoning|answer)>", re.IGNORECASE)


def reasoning_text(completion: str) -> str:
    """The completion without its answer spans and tag markup, whitespace-normalised."""
    return " ".join(_MARKUP.sub(" ", _ANSWER_SPAN.sub(" ", completion)).split())


@functools.lru_cache(maxsize=4)
def load_encoder(path: str | None = None):
    """The sentence encoder at ``path`` (default MiniLM), loaded once per path and cached."""
    # Local: jax, flax and the model stack load only when a run uses this reward.
    from jaxgrpo.models.encoder import SentenceEncoder

    return SentenceEncoder.from_pretrained(path)


def embedding(
    prompts: list[str],
    completions: list[str],
    *,
    reference: list[str | None],
    encoder_path: str | None = None,
    **_,
) -> list[float | None]:
    """Cosine similarity of each completion's reasoning to its reference solution.

    Args:
      prompts: unused (kept for the reward signature).
      completions: generated texts.
      reference: reference solutions, one per completion (None: cannot score).
      encoder_path: a local sentence-transformers BERT directory (None: all-MiniLM-L6-v2).

    Returns:
      One float in [-1, 1] per completion, 0.0 for an empty reasoning, None without reference.
    """
    del prompts
    if len(reference) != len(completions):
        raise ValueError(f"embedding: {len(completions)} completions but {len(reference)} refs")
    reasons = [reasoning_text(c) for c in completions]
    scored = [i for i, (r, ref) in enumerate(zip(reasons, reference, strict=True)) if r and ref]
    out: list[float | None] = [None if ref is None else 0.0 for ref in reference]
    if not scored:
        return out
    texts = [reasons[i] for i in scored] + [str(reference[i]) for i in scored]
    e_ND = load_encoder(encoder_path).encode(texts)
    n = len(scored)
    cos_N = np.clip((e_ND[:n] * e_ND[n:]).sum(-1), -1.0, 1.0)
    for i, c in zip(scored, cos_N, strict=True):
        out[i] = float(c)
    return out
