"""Packing a group's completions end to end into one row, for the scoring passes.

The G completions of a prompt differ in length; padding each to the longest scores mostly
padding once a policy answers briefly. Packed, a group's completions run end to end in one row
of L columns against the group's prompt (`jaxgrpo.models.logprobs.packed_logprobs`), each token
attending the prompt and the earlier tokens of its own completion. Used by the learner's
scoring passes and by the perplexity reward.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax.numpy as jnp
import numpy as np

from jaxgrpo.core.shapes import Array
from jaxgrpo.models.tokenizer import bucket_length

# A packed row is the longest group's tokens rounded up to a multiple of this many columns
# where that is narrower than their half-octave bucket: with long completions scoring is most
# of a step, and a group of 2,780 tokens then scores 2,816 columns, not 3,072 (the banded
# attention's blocks are 128 wide there). Each new width compiles the scoring programs once
# (`jaxgrpo.rl.rollout.ShapeBuckets`).
PACK_STEP = 128


class _Widths(Protocol):  # `jaxgrpo.rl.rollout.ShapeBuckets`
    def grow(self, name: str, width: int) -> int: ...


@flax.struct.dataclass
class Packing:
    """Where each group's completions sit when packed end to end into one row of L tokens.

    Column c of group b's packed row holds token j = pos[b, c] of completion g = seg[b, c]
    of that group (seg is -1 on padding columns), read from index src[b, c] = g * T + j of the
    group's completions flattened to [G * T]. `unpack[n, j]` is the packed column of token
    (n, j), or L for the columns past that completion's end. Built on the host by `pack`.
    """

    src_BL: Array
    seg_BL: Array
    pos_BL: Array
    unpack_NT: Array

    def take(self, groups_M: Array, rows_R: Array) -> Packing:
        """The packing of groups `groups_M`, whose completions are rows `rows_R`."""
        return Packing(
            src_BL=jnp.take(self.src_BL, groups_M, axis=0),
            seg_BL=jnp.take(self.seg_BL, groups_M, axis=0),
            pos_BL=jnp.take(self.pos_BL, groups_M, axis=0),
            unpack_NT=jnp.take(self.unpack_NT, rows_R, axis=0),
        )


def pack(lengths_R: np.ndarray, group_size: int, t: int, buckets: _Widths | None = None) -> Packing:
    """Packs the completions of each group of `group_size` rows end to end (numpy arrays).

    Args:
        lengths_R: tokens to score per completion (up to and including its stop token).
        group_size: G; row b*G + g is completion g of group b.
        t: T, the completions' column count.
        buckets: the run's `ShapeBuckets`: L never falls below an earlier step's.

    Returns:
        `Packing` with L = the longest group's total length rounded up to its half-octave
        bucket (2^k or 3 * 2^(k-1), at least 16) or to a multiple of `PACK_STEP`, whichever is
        smaller, at most G * T: with short completions a group's row is far shorter than G * T;
        short rows keep few shapes, and a long row pads its longest group by less than
        `PACK_STEP` columns.
    """
    lengths_BG = np.minimum(np.asarray(lengths_R), t).reshape(-1, group_size)
    b = lengths_BG.shape[0]
    longest = int(lengths_BG.sum(axis=1).max(initial=1))
    width = bucket_length(longest, 16, group_size * t, half_octaves=True)
    width = min(width, -(-longest // PACK_STEP) * PACK_STEP)
    if buckets is not None:
        width = buckets.grow("packed", width)
    src = np.zeros((b, width), np.int32)
    seg = np.full((b, width), -1, np.int32)
    pos = np.zeros((b, width), np.int32)
    unpack = np.full((b, group_size, t), width, np.int32)
    for i in range(b):
        col = 0
        for g, n in enumerate(lengths_BG[i]):
            j = np.arange(n)
            src[i, col : col + n] = g * t + j
            seg[i, col : col + n] = g
            pos[i, col : col + n] = j
            unpack[i, g, :n] = col + j
            col += n
    return Packing(src, seg, pos, unpack.reshape(b * group_size, t))
