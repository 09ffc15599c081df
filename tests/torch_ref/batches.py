"""Random ragged loss inputs (numpy, float64) shared by the loss tests and the torch reference."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class LossBatch:
    """One batch of per-token loss inputs; entries outside ``mask`` hold finite garbage.

    Attributes:
      logp: ``[N, T]`` current-policy log-probs.
      old_logp: ``[N, T]`` behaviour-policy log-probs (ratios spread over the clip range).
      ref_logp: ``[N, T]`` reference log-probs.
      advantages: ``[N]`` advantages, one exactly 0.
      mask: ``[N, T]`` bool valid tokens; row 0 is full, row 1 is empty.
      entropy: ``[N, T]`` per-token entropies.
      logits: ``[N, T, V]`` logits.
      is_weights: ``[N, T]`` importance weights in ``(0, 2)``.
      teacher_logp: ``[N, T]`` a teacher's log-probs (garbage outside ``mask``).
    """

    logp: np.ndarray
    old_logp: np.ndarray
    ref_logp: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    entropy: np.ndarray
    logits: np.ndarray
    is_weights: np.ndarray
    teacher_logp: np.ndarray | None = None


def random_batch(seed: int, n: int = 8, t: int = 9, v: int = 11) -> LossBatch:
    """A ragged batch whose ratios exceed 3 and fall below 0.5 on some tokens of each sign."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, n)
    lengths[0], lengths[1] = t, 0
    mask = np.arange(t)[None, :] < lengths[:, None]
    logp = np.log(rng.uniform(0.05, 1.0, (n, t)))
    old_logp = logp + rng.normal(0.0, 0.8, (n, t))
    old_logp[2:, 0] = logp[2:, 0] - np.log(4.0) * np.sign(rng.normal(size=n - 2))
    ref_logp = logp + rng.normal(0.0, 0.5, (n, t))
    advantages = rng.normal(0.0, 1.0, n)
    advantages[2] = 0.0
    garbage = ~mask
    for arr in (logp, old_logp, ref_logp):
        arr[garbage] = rng.normal(0.0, 4.0, int(garbage.sum()))
    batch = LossBatch(
        logp=logp,
        old_logp=old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        mask=mask,
        entropy=rng.uniform(0.0, 3.0, (n, t)),
        logits=rng.normal(0.0, 2.0, (n, t, v)),
        is_weights=rng.uniform(0.0, 2.0, (n, t)),
    )
    batch.teacher_logp = np.where(
        mask, logp + rng.normal(0.0, 1.0, (n, t)), rng.normal(0, 4, (n, t))
    )
    return batch
