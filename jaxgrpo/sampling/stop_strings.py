"""Stop strings inside the compiled decode loop: a row stops at the token whose text completes
one of the strings, with no host round trip per token (vLLM's ``stop``, and what a tool call's
closing tag needs: the turn ends at the call, so its result can follow).

A string can be split over several tokens, and one token can both finish a string and carry
text after it (SmolLM2 writes ``</calc><result>`` as ``</`` ``calc`` ``><`` ``result`` ``>``).
So each row carries, per string s of n bytes, a match state ``partial_RSL``: bit j is set when
the text so far ends with ``s[:j]`` (bit 0 always). A token with bytes w then

- completes s when ``s`` lies inside w, or some set bit j has ``w.startswith(s[j:])``;
- leaves bit k set when w ends with ``s[:k]``, or when w is ``s[k - len(w):k]`` and bit
  ``k - len(w)`` was set (an empty token keeps every bit).

Those four predicates depend on the token alone, so they are tables over the vocabulary built
once on the host (``StopTables.build``) and read with one gather per step; matching is on
bytes, as byte-level BPE vocabularies (Llama 3, Qwen, SmolLM2) store their tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax.numpy as jnp
import numpy as np

from jaxgrpo.core.shapes import Array


def check_stop_strings(strings: Sequence[str], key: str = "sampling.stop") -> tuple[str, ...]:
    """``strings`` as a tuple, or ``ValueError`` naming ``key`` for an empty or repeated one."""
    strings = tuple(strings)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{key}: stop strings must be non-empty strings, got {s!r}")
    repeated = sorted({s for s in strings if strings.count(s) > 1})
    if repeated:
        raise ValueError(f"{key}: stop string {repeated[0]!r} is given twice")
    return strings


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    visible = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def token_bytes(hf: Any) -> list[bytes]:
    """Each vocabulary id's bytes for a Hugging Face tokenizer: special and added tokens as
    their text, byte-level tokens through the byte alphabet, others (SentencePiece pieces) as
    their decoded text."""
    decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    byte_level = "ByteLevel" in kinds
    alphabet = _byte_decoder()
    added = {int(i): t.content for i, t in (hf.added_tokens_decoder or {}).items()}
    out = []
    for i, piece in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
        if i in added:
            out.append(added[i].encode())
        elif piece is not None and byte_level and all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        else:
            out.append(hf.decode([i]).encode())
    return out


@flax.struct.dataclass
class StopTables:
    """Per-token predicates of S stop strings of at most L bytes (bits j, k < L).

    Attributes:
      contains_VS: bool [V, S]; the token's bytes hold the whole string.
      finishes_VSL: bool [V, S, L]; after ``s[:j]`` the token completes s (j >= 1).
      ends_VSL: bool [V, S, L]; the token's bytes end with ``s[:k]`` (k >= 1).
      inside_VSL: bool [V, S, L]; the token's bytes are ``s[k - n:k]`` with n < k its length
        (every k for an empty token).
      length_V: int32 [V]; the token's length in bytes.
    """

    contains_VS: Array
    finishes_VSL: Array
    ends_VSL: Array
    inside_VSL: Array
    length_V: Array

    @classmethod
    def build(cls, strings: Sequence[str], vocabulary: Sequence[bytes]) -> StopTables:
        """The tables of ``strings`` over a vocabulary of token bytes (``token_bytes``)."""
        targets = [s.encode() for s in check_stop_strings(strings)]
        v, s_count = len(vocabulary), len(targets)
        width = max(len(t) for t in targets)
        contains = np.zeros((v, s_count), bool)
        finishes, ends, inside = (np.zeros((v, s_count, width), bool) for _ in range(3))
        lengths = np.array([len(w) for w in vocabulary], np.int32)
        for si, s in enumerate(targets):
            pieces = {s[a:b] for a in range(len(s)) for b in range(a, len(s) + 1)}
            alphabet = set(s)
            for t, w in enumerate(vocabulary):
                if not w:
                    inside[t, si, 1 : len(s)] = True
                    continue
                if alphabet.isdisjoint(w):  # shares no byte with s: every predicate is false
                    continue
                contains[t, si] = s in w
                for j in range(1, len(s)):
                    finishes[t, si, j] = w.startswith(s[j:])
                    ends[t, si, j] = w.endswith(s[:j])
                    inside[t, si, j] = len(w) < j and w in pieces and s[j - len(w) : j] == w
        return cls(
            jnp.asarray(contains),
            jnp.asarray(finishes),
            jnp.asarray(ends),
            jnp.asarray(inside),
            jnp.asarray(lengths),
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(S, L): strings and the longest one's bytes."""
        return self.finishes_VSL.shape[1], self.finishes_VSL.shape[2]

    def start(self, rows: int) -> Array:
        """The match state of ``rows`` fresh rows: bool [R, S, L], only bit 0 set."""
        s, width = self.shape
        return jnp.zeros((rows, s, width), bool).at[:, :, 0].set(True)

    def advance(self, partial_RSL: Array, token_R: Array) -> tuple[Array, Array]:
        """The rows' state after ``token_R``, and bool [R]: the token completed a string."""
        finishes = jnp.take(self.finishes_VSL, token_R, axis=0)
        hit_R = jnp.any(jnp.take(self.contains_VS, token_R, axis=0), axis=1)
        hit_R |= jnp.any(partial_RSL & finishes, axis=(1, 2))
        width = partial_RSL.shape[2]
        back_RL = jnp.arange(width)[None, :] - jnp.take(self.length_V, token_R)[:, None]
        carried = jnp.take_along_axis(partial_RSL, jnp.clip(back_RL, 0)[:, None, :], axis=2)
        inside = jnp.take(self.inside_VSL, token_R, axis=0)
        after = jnp.take(self.ends_VSL, token_R, axis=0) | (inside & carried)
        return after.at[:, :, 0].set(True), hit_R
