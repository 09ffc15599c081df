"""The decoder's key/value caches as explicit pytrees (in and out of jit).

`KVCache` is the prompt pass's (`Transformer.prefill`), `LayerKVCache` the decode steps'
(`Transformer.decode_step`); the scoring passes keep no cache: their segments attend each
other's keys and values layer by layer (`Transformer.forward_segments`).

Every row writes at the same slot (`index`), which is what left padding buys: prompts are
left-padded to a common length P, so prefill fills slots [0, P) for all rows and each decode
step fills slot `index` with one `dynamic_update_slice`. Rows differ only in which slots are
valid (`mask`) and in their next position id (`next_pos`).
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from jaxgrpo.core.shapes import Array
from jaxgrpo.core.sharding import ShardingCtx, shard_act
from jaxgrpo.models.config import ModelConfig

CACHE_AXES = ("layers", "act_batch", "act_kv_length", "act_kv_heads", "act_head_dim")
_KEYS = ("act_batch", "act_kv_heads", "act_head_dim", "act_kv_length")  # [B, K, H, S]
_VALUES = ("act_batch", "act_kv_heads", "act_kv_length", "act_head_dim")  # [B, K, S, H]


@flax.struct.dataclass
class KVCache:
    """Stacked per-layer keys and values, written by `Transformer.prefill`.

    Attributes:
        k: keys [L, B, S, K, H], RoPE already applied.
        v: values [L, B, S, K, H].
        mask: [B, S] bool, True at slots holding a real (non-pad) token.
        next_pos: [B] int32, the position id the next real token of each row will get.
        index: int32 scalar, the next slot to write (shared by all rows).
    """

    k: Array
    v: Array
    mask: Array
    next_pos: Array
    index: Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def constrain(self, ctx: ShardingCtx | None) -> KVCache:
        """The cache pinned to the activation rules: rows over the batch axes, heads over
        tensor (without this XLA may keep a zero-initialised cache whole on every device)."""
        return self.replace(
            k=shard_act(self.k, CACHE_AXES, ctx),
            v=shard_act(self.v, CACHE_AXES, ctx),
            mask=shard_act(self.mask, ("act_batch", None), ctx),
        )

    def repeat(self, group: int) -> KVCache:
        """Repeats each row `group` times: row b becomes rows b*G .. b*G+G-1.

        Used after a shared prompt prefill to decode G samples per prompt.
        """
        return KVCache(
            k=jnp.repeat(self.k, group, axis=1),
            v=jnp.repeat(self.v, group, axis=1),
            mask=jnp.repeat(self.mask, group, axis=0),
            next_pos=jnp.repeat(self.next_pos, group, axis=0),
            index=self.index,
        )


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for `batch` rows and `max_len` slots.

    Args:
        cfg: the model config (L, K, H).
        batch: B.
        max_len: S, at least prompt length + new tokens.
        dtype: storage dtype of k and v; defaults to the model's compute dtype.
    """
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch, max_len), jnp.bool_),
        next_pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


@flax.struct.dataclass
class LayerKVCache:
    """The decode-time cache of `Transformer.decode_step`: heads before slots, the prompt
    stored once per prompt.

    The scanned `KVCache` suits prefill and training, but in a one-token decode step its
    [B, S, K, H] layout makes the attention dots transpose it. Here keys are [B, K, H, S]
    (the scores' right-hand operand [contracted, free], the order XLA:CPU's dot library takes
    without a copy) and values [B, K, S, H] (already that order for `probs @ v`).

    Each of the four buffers is either a tuple of L per-layer arrays, for the unrolled decode
    loop (on XLA:CPU reading layer i out of a stacked buffer copies it at every step), or one
    stacked array with a leading [L] axis, for the scanned one (`Layout.decode_loop`).
    Both are updated in place: the loop donates them.

    The G samples of a prompt share its keys and values, so the prompt part keeps one row per
    prompt and `repeat(G)` repeats only the completion part: a decode step reads the prompt
    cache once per group (`layers.attend(prompt=...)`), not once per sample.

    Attributes:
        prompt_k: prompt keys [B, K, H, P] per layer, RoPE already applied.
        prompt_v: prompt values [B, K, P, H] per layer.
        prompt_mask: [B, P] bool, True at real (non-pad) prompt slots.
        k: completion keys [R, K, H, S] per layer, R = B * G rows.
        v: completion values [R, K, S, H] per layer.
        mask: [R, S] bool, True at completion slots holding a token.
        next_pos: [R] int32, the position id of each row's next token.
        index: int32 scalar, the next completion slot to write (shared by all rows).
    """

    prompt_k: tuple[Array, ...] | Array
    prompt_v: tuple[Array, ...] | Array
    prompt_mask: Array
    k: tuple[Array, ...] | Array
    v: tuple[Array, ...] | Array
    mask: Array
    next_pos: Array
    index: Array

    @property
    def stacked(self) -> bool:
        """True when the buffers are stacked [L, ...] arrays (the scanned decode loop)."""
        return not isinstance(self.k, tuple)

    @classmethod
    def from_prompt(cls, cache: KVCache, new_tokens: int, stacked: bool = False) -> LayerKVCache:
        """A `KVCache` whose every slot was filled by the prompt pass (S = P), as the shared
        prompt part, plus `new_tokens` empty completion slots per row; `stacked` as above."""
        layers, b, _, k, h = cache.k.shape
        if stacked:
            return cls(
                prompt_k=cache.k.transpose(0, 1, 3, 4, 2),
                prompt_v=cache.v.transpose(0, 1, 3, 2, 4),
                prompt_mask=cache.mask,
                k=jnp.zeros((layers, b, k, h, new_tokens), cache.k.dtype),
                v=jnp.zeros((layers, b, k, new_tokens, h), cache.k.dtype),
                mask=jnp.zeros((b, new_tokens), jnp.bool_),
                next_pos=cache.next_pos,
                index=jnp.zeros((), jnp.int32),
            )
        split = lambda x, order: tuple(x[i].transpose(order) for i in range(layers))  # noqa: E731
        empty = lambda shape: tuple(jnp.zeros(shape, cache.k.dtype) for _ in range(layers))  # noqa: E731
        return cls(
            prompt_k=split(cache.k, (0, 2, 3, 1)),
            prompt_v=split(cache.v, (0, 2, 1, 3)),
            prompt_mask=cache.mask,
            k=empty((b, k, h, new_tokens)),
            v=empty((b, k, new_tokens, h)),
            mask=jnp.zeros((b, new_tokens), jnp.bool_),
            next_pos=cache.next_pos,
            index=jnp.zeros((), jnp.int32),
        )

    def _each(self, buffers, fn):
        """`fn(array, row_axis)` applied to every layer's array of ``buffers``: the stacked
        [L, ...] array at once, or each per-layer array."""
        if self.stacked:
            return fn(buffers, 1)
        return tuple(fn(x, 0) for x in buffers)

    def constrain(self, ctx: ShardingCtx | None) -> LayerKVCache:
        """The cache pinned to the activation rules, as `KVCache.constrain`. The completion
        part starts as zeros, which XLA would otherwise replicate on every chip (see
        benchmarks/README.md, "The decode cache")."""

        def pin(axes):
            return lambda x, row_axis: shard_act(x, ("layers",) * row_axis + axes, ctx)

        rows = ("act_batch",)
        return self.replace(
            prompt_k=self._each(self.prompt_k, pin(_KEYS)),
            prompt_v=self._each(self.prompt_v, pin(_VALUES)),
            prompt_mask=shard_act(self.prompt_mask, (*rows, None), ctx),
            k=self._each(self.k, pin(_KEYS)),
            v=self._each(self.v, pin(_VALUES)),
            mask=shard_act(self.mask, (*rows, None), ctx),
            next_pos=shard_act(self.next_pos, rows, ctx),
        )

    def repeat(self, group: int) -> LayerKVCache:
        """Repeats each row `group` times: row r becomes rows r*G .. r*G+G-1.

        The prompt part is not copied: row r's prompt is prompt r // (rows per prompt).
        """
        rep = lambda x, axis: jnp.repeat(x, group, axis=axis)  # noqa: E731
        return self.replace(
            k=self._each(self.k, rep),
            v=self._each(self.v, rep),
            mask=jnp.repeat(self.mask, group, axis=0),
            next_pos=jnp.repeat(self.next_pos, group, axis=0),
        )

    def grow(self, size: int) -> LayerKVCache:
        """The completion part with ``size`` slots: the written ones, then empty ones."""
        extra = size - self.mask.shape[1]
        if extra < 0:
            raise ValueError(f"cannot grow a {self.mask.shape[1]}-slot cache to {size} slots")

        def pad(slot_axis):  # k: slots last; v: slots before the head dimension
            def fn(x, _):
                widths = [(0, 0)] * x.ndim
                widths[x.ndim + slot_axis] = (0, extra)
                return jnp.pad(x, widths)

            return fn

        return self.replace(
            k=self._each(self.k, pad(-1)),
            v=self._each(self.v, pad(-2)),
            mask=jnp.pad(self.mask, ((0, 0), (0, extra))),
        )

    def take(self, rows: Array) -> LayerKVCache:
        """Rows `rows` [M] only, each with its own copy of its prompt's keys and values.

        The sampler uses it to go on decoding only the rows still running; the result has
        one prompt row per row (groups of one).
        """
        group = self.mask.shape[0] // self.prompt_mask.shape[0]
        prompt_rows = rows // group
        take = lambda r: lambda x, axis: jnp.take(x, r, axis=axis)  # noqa: E731
        return LayerKVCache(
            prompt_k=self._each(self.prompt_k, take(prompt_rows)),
            prompt_v=self._each(self.prompt_v, take(prompt_rows)),
            prompt_mask=jnp.take(self.prompt_mask, prompt_rows, axis=0),
            k=self._each(self.k, take(rows)),
            v=self._each(self.v, take(rows)),
            mask=jnp.take(self.mask, rows, axis=0),
            next_pos=jnp.take(self.next_pos, rows, axis=0),
            index=self.index,
        )

    def put(self, rows: Array, sub: LayerKVCache) -> LayerKVCache:
        """This cache with the completion part of rows ``rows`` [M] replaced by ``sub``'s (a
        ``take(rows)`` of it, decoded further): the sampler writes compacted rows back when a
        later turn continues from the cache. ``sub`` has as many slots; its index is taken."""

        def put(full, part):
            axis = 1 if self.stacked else 0
            index = (slice(None),) * axis + (rows,)
            return full.at[index].set(part)

        pairs = lambda a, b: (  # noqa: E731
            put(a, b) if self.stacked else tuple(put(x, y) for x, y in zip(a, b, strict=True))
        )
        return self.replace(
            k=pairs(self.k, sub.k),
            v=pairs(self.v, sub.v),
            mask=self.mask.at[rows].set(sub.mask),
            next_pos=self.next_pos.at[rows].set(sub.next_pos),
            index=sub.index,
        )

    def resume(
        self, rows: Array, valid_until: Array, next_pos: Array, width: int, new_slots: int
    ) -> LayerKVCache:
        """Rows ``rows`` [N] for a later turn of an episode: each row's prompt, then its
        completion slots that hold a token before slot ``valid_until`` [N] (what follows was
        sampled past the turn's cut, so it is dropped), moved to the last of ``width`` slots in
        order, then ``new_slots`` empty ones; the next token is written at slot ``width`` and
        gets position ``next_pos`` [N]. Attention only sees which slots are valid and the
        positions RoPE gave them, so the moved slots keep their meaning, as left padding does.
        """
        sub = self.take(rows)
        if sub.mask.shape[1] < width:
            sub = sub.grow(width)
        slots = sub.mask.shape[1]
        valid_NS = sub.mask & (jnp.arange(slots)[None, :] < valid_until[:, None])
        # Invalid slots first, valid ones after them in order: the last `width` are the row's.
        order_NS = jnp.argsort(valid_NS.astype(jnp.int8), axis=1, stable=True)
        order_NW = order_NS[:, slots - width :]

        def gather(slot_axis):
            def fn(x, row_axis):
                shape = [1] * x.ndim
                shape[row_axis], shape[x.ndim + slot_axis] = order_NW.shape
                moved = jnp.take_along_axis(x, order_NW.reshape(shape), axis=slot_axis)
                widths = [(0, 0)] * x.ndim
                widths[x.ndim + slot_axis] = (0, new_slots)
                return jnp.pad(moved, widths)

            return fn

        mask_NW = jnp.take_along_axis(valid_NS, order_NW, axis=1)
        return sub.replace(
            k=sub._each(sub.k, gather(-1)),
            v=sub._each(sub.v, gather(-2)),
            mask=jnp.pad(mask_NW, ((0, 0), (0, new_slots))),
            next_pos=next_pos.astype(jnp.int32),
            index=jnp.asarray(width, jnp.int32),
        )
