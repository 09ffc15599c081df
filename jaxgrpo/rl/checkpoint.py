"""Orbax checkpoints: any pytree of arrays plus a JSON item, atomic, keep-last-K, exact resume.

A checkpoint holds two items:

- ``state``: the training pytree (trainable parameters, optimizer state, step, RNG key). It is
  stored flat, leaf by leaf, under index names, so any pytree type (NNX ``State``, optax
  states, flax dataclasses) round-trips; the tree structure comes back from the restore target.
- ``meta``: a JSON object (data cursor, schedule state, the config snapshot).
- ``sampler`` (asynchronous rollouts only): the trainable params of the policy versions the
  in-flight batches are sampled with, so a resumed run samples them again exactly.

Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact. Restoring places every array with the target's
sharding, so a run resumes onto its mesh without a gather on one host. Typed PRNG keys are saved
as their raw key data and re-wrapped on restore.

A checkpoint never holds a non-finite value: the learner skips such updates, and ``save``
asserts it (a NaN written to disk would poison every later resume).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxgrpo.core.shapes import PyTree


class NonFiniteCheckpointError(ValueError):
    """Raised instead of writing a checkpoint that contains NaN or Inf."""


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flatten(tree: PyTree) -> tuple[list[str], list[Any], Any]:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_path]
    return paths, [leaf for _, leaf in leaves_with_path], treedef


def _storable(leaf: Any) -> Any:
    """Arrays as they are (keys as their uint32 data); Python/NumPy scalars as NumPy arrays."""
    if _is_key(leaf):
        return jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array):
        return leaf
    return np.asarray(leaf)


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def assert_finite(tree: PyTree) -> None:
    """Raises ``NonFiniteCheckpointError`` naming the first leaf with a NaN or Inf."""
    paths, leaves, _ = _flatten(tree)
    floats = [
        (p, x)
        for p, x in zip(paths, leaves, strict=True)
        if not _is_key(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not floats:
        return
    flags = jax.device_get(_all_finite([jnp.asarray(x) for _, x in floats]))
    bad = [p for (p, _), ok in zip(floats, flags, strict=True) if not ok]
    if bad:
        raise NonFiniteCheckpointError(
            f"refusing to checkpoint non-finite values in {len(bad)} leaves, e.g. {bad[:3]}; "
            "the learner must skip non-finite updates before they reach the state"
        )


class Checkpointer:
    """Saves every ``every`` steps (and on ``force``), keeps the last ``keep`` checkpoints.

    All processes of a multi-host run call ``save`` and ``restore`` together; orbax
    coordinates the writes.
    """

    def __init__(self, directory: str, *, every: int, keep: int):
        """Args:
        directory: where the step directories go (created if missing).
        every: save period in steps; 0 saves only when forced (at exit).
        keep: number of most recent checkpoints kept.
        """
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(
            directory if "://" in directory else os.path.abspath(directory),  # gs:// as is
            options=options,
            item_names=("state", "meta", "sampler"),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        return list(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a periodic save point."""
        return self.every > 0 and step % self.every == 0

    def save(
        self,
        step: int,
        state: PyTree,
        meta: Mapping[str, Any],
        *,
        force: bool = False,
        sampler: Mapping[int, PyTree] | None = None,
    ):
        """Writes ``state`` and ``meta`` as checkpoint ``step`` when due (or ``force``).

        Args:
          step: the number of completed training steps this state reflects.
          state: the training pytree.
          meta: JSON-serialisable dict.
          force: save even when ``step`` is not a multiple of ``every``.
          sampler: version -> trainable params the in-flight batches are sampled with
            (asynchronous rollouts), or None.

        Returns:
          True when a checkpoint was written (False if not due or already present).

        Raises:
          NonFiniteCheckpointError: a floating leaf holds NaN or Inf.
        """
        if not (force or self.should_save(step)) or step in self.all_steps():
            return False
        assert_finite(state)
        paths, leaves, _ = _flatten(state)
        items = {f"{i:05d}": _storable(leaf) for i, leaf in enumerate(leaves)}
        meta = {**meta, "_leaf_paths": paths}
        args = {"state": ocp.args.StandardSave(items)}
        if sampler:
            meta["_sampler_versions"] = sorted(sampler)
            held = [sampler[v] for v in sorted(sampler)]
            flat = {f"{i:05d}": leaf for i, leaf in enumerate(_flatten(held)[1])}
            args["sampler"] = ocp.args.StandardSave(flat)
        args["meta"] = ocp.args.JsonSave(dict(meta))
        self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        self._manager.wait_until_finished()
        return True

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, dict[str, Any]]:
        """Restores checkpoint ``step`` (default: latest) into the structure of ``target``.

        Args:
          target: a pytree with the saved structure; its arrays (concrete or
            ``jax.ShapeDtypeStruct``) give each leaf's shape, dtype and sharding.
          step: which checkpoint; None = the latest.

        Returns:
          (state, meta): state has target's structure and shardings.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        paths, leaves, treedef = _flatten(target)
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(meta.meta)
        saved_paths = meta.pop("_leaf_paths")
        if saved_paths != paths:
            diff = sorted(set(saved_paths) ^ set(paths))[:5]
            raise ValueError(
                f"checkpoint {step} has a different tree structure than the restore target "
                f"({len(saved_paths)} vs {len(paths)} leaves; differing paths e.g. {diff})"
            )
        abstract = {f"{i:05d}": _abstract(leaf) for i, leaf in enumerate(leaves)}
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
        values = [_rebuild(restored[f"{i:05d}"], leaf) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, values), meta

    def restore_sampler(self, params: PyTree, step: int) -> dict[int, PyTree]:
        """version -> trainable params of checkpoint ``step``'s in-flight batches (``{}`` when
        it holds none), each restored into the structure and shardings of ``params``."""
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        versions = list(dict(meta.meta).get("_sampler_versions", []))
        if not versions:
            return {}
        paths, leaves, treedef = _flatten([params] * len(versions))
        abstract = {f"{i:05d}": _abstract(leaf) for i, leaf in enumerate(leaves)}
        restored = self._manager.restore(
            step, args=ocp.args.Composite(sampler=ocp.args.StandardRestore(abstract))
        ).sampler
        held = jax.tree_util.tree_unflatten(
            treedef, [restored[f"{i:05d}"] for i in range(len(leaves))]
        )
        return dict(zip(versions, held, strict=True))

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _abstract(leaf: Any) -> Any:
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return np.asarray(leaf)


def _rebuild(value: Any, target: Any) -> Any:
    if _is_key(target):
        impl = jax.random.key_impl(target) if isinstance(target, jax.Array) else None
        return jax.random.wrap_key_data(value, impl=impl)
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        return value
    return type(target)(np.asarray(value).item())
