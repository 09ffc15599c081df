"""Meshes, logical-axis rules, activation constraints and multi-host initialisation.

Parameters carry logical axis names (`logical_axes` metadata, see `jaxgrpo.models.layers`);
activations name theirs at `shard_act` call sites. A short rule table maps each logical name to
mesh axes. Weights and activations use separate names (`embed` vs `act_embed`) because a
dimension shards differently on a weight (embed -> fsdp) than on an activation, where the batch
already uses fsdp. The mesh and rules travel explicitly in a `ShardingCtx`; there is no global
or thread-local mesh.

Mesh axes: data (pure data parallel), fsdp (data parallel + weight sharding), tensor (heads,
mlp and vocab split across devices).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo.core import presets

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Training: weights sharded over fsdp (embed) and tensor (heads/mlp/vocab); batch over data+fsdp.
TRAIN_RULES: Rules = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("lora_rank", None),
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_kv_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

# Sampling: weights replicated over fsdp (no all-gather per decode step), tensor-parallel only
# (the decode layers' matrices are pinned Megatron-style, see `models.decode`).
SAMPLE_RULES: Rules = tuple((k, None) if k == "embed" else (k, v) for k, v in TRAIN_RULES)

# Sampling a model whose SAMPLE_RULES copy does not fit (an 8B model on v5e-8, which has no
# tensor axis): tensor-parallel over fsdp x tensor, every chip holding its share of the heads,
# the MLP and the vocabulary of every row; rows split over data only.
_SPLIT = ("fsdp", "tensor")
_SPLIT_NAMES = ("vocab", "heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp")
_SAMPLE_TP = {"embed": None, "act_batch": "data", "act_vocab": _SPLIT} | {
    k: _SPLIT for k in _SPLIT_NAMES
}
SAMPLE_TP_RULES: Rules = tuple((k, _SAMPLE_TP.get(k, v)) for k, v in TRAIN_RULES)

# Fraction of a chip's HBM the sampler may spend on its copy of the weights: the decode
# program holds them twice (the resharded state and the per-layer decode matrices).
SAMPLE_WEIGHT_FRACTION = 0.3


@dataclasses.dataclass(frozen=True)
class ShardingCtx:
    """An explicit (mesh, rules) pair passed to `shard_act` and to the model."""

    mesh: Mesh
    rules: Rules = TRAIN_RULES


def sampling_layout(mesh_shape: dict[str, int], weight_bytes: float, hbm_bytes: float) -> str:
    """The name of the rules the sampler decodes under (see `sampling_rules`), from sizes."""
    budget = SAMPLE_WEIGHT_FRACTION * hbm_bytes
    if weight_bytes / mesh_shape["tensor"] <= budget:
        return "sample"
    split = mesh_shape["fsdp"] * mesh_shape["tensor"]
    if mesh_shape["fsdp"] > 1 and weight_bytes / split <= budget:
        return "sample_tp"
    return "train"


def sampling_rules(mesh: Mesh, weight_bytes: float) -> Rules:
    """The rules the sampler decodes under on ``mesh``, for weights of ``weight_bytes``.

    ``SAMPLE_RULES`` (weights replicated over data x fsdp, split over tensor) when the split
    weights fit in ``SAMPLE_WEIGHT_FRACTION`` of a chip's memory, so a decode step needs no
    collective beyond the tensor-parallel all-reduces; else ``SAMPLE_TP_RULES`` (split over
    fsdp x tensor, the same all-reduces over more chips) when that fits; else ``TRAIN_RULES``
    (weights stay fsdp-sharded and every projection gathers or reduces at every token).
    """
    chip = presets.chip_of(mesh.devices.flat[0])
    name = sampling_layout(dict(mesh.shape), weight_bytes, chip.hbm_bytes)
    return {"sample": SAMPLE_RULES, "sample_tp": SAMPLE_TP_RULES, "train": TRAIN_RULES}[name]


def rule_axes(rules: Rules, name: str) -> tuple[str, ...]:
    """The mesh axes logical axis ``name`` maps to under ``rules`` (() = replicated)."""
    axes = dict(rules).get(name)
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def rules_name(rules: Rules) -> str:
    """ "train", "sample", "sample_tp" or "custom"."""
    names = {TRAIN_RULES: "train", SAMPLE_RULES: "sample", SAMPLE_TP_RULES: "sample_tp"}
    return names.get(rules, "custom")


def make_mesh(shape: dict[str, int] | None = None, devices=None) -> Mesh:
    """A mesh over (data, fsdp, tensor).

    Args:
        shape: axis -> size; missing axes get 1, one axis may be -1 to take the remaining devices.
            Default: everything on fsdp.
        devices: defaults to `jax.devices()`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {"fsdp": -1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"Unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.")
    sizes = [shape.get(a, 1) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"At most one mesh axis may be -1, got {shape}.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh {shape}.")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
            f"have {len(devices)}."
        )
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(sizes, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(
    names: tuple[str | None, ...],
    rules: Rules,
    shape: tuple[int, ...] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    Args:
        names: one logical name per dimension (None = replicated).
        rules: the rule table.
        shape / mesh: when given, a mesh axis that does not divide its dimension (e.g. 3 kv
            heads over tensor=2) is dropped, replicating that dimension instead of failing.

    Raises:
        ValueError: a name has no rule (the message names it).
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"No sharding rule for logical axis {name!r}; rules: {sorted(table)}.")
        axes = tuple(
            a for a in rule_axes(rules, name) if a not in used
        )  # a mesh axis may appear only once
        if shape is not None and mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def shard_act(x: jax.Array, names: tuple[str | None, ...], ctx: ShardingCtx | None) -> jax.Array:
    """Constrains an activation's sharding by logical names; `ctx=None` leaves x untouched."""
    if ctx is None:
        return x
    spec = logical_to_spec(names, ctx.rules, x.shape, ctx.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state, rules: Rules, mesh: Mesh | None = None):
    """PartitionSpecs (as Variable values) for a state whose Variables have `logical_axes`."""

    def spec(v):
        names = v.get_metadata("logical_axes") if v.has_metadata("logical_axes") else None
        value = v.get_value()
        if names is None:
            return v.replace(PartitionSpec())
        return v.replace(logical_to_spec(names, rules, tuple(value.shape), mesh))

    return jax.tree.map(spec, state, is_leaf=_is_var)


def param_shardings(abstract_state, mesh: Mesh, rules: Rules):
    """NamedShardings matching `abstract_state` (real or `nnx.eval_shape` state)."""
    specs = param_specs(abstract_state, rules, mesh)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)


def replicated(mesh: Mesh) -> NamedSharding:
    """The whole array on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rows: int, ndim: int, rules: Rules = TRAIN_RULES) -> NamedSharding:
    """Rows over the mesh axes of the ``act_batch`` rule when they divide evenly, else
    replicated; the other ``ndim - 1`` dimensions whole."""
    axes = rule_axes(rules, "act_batch")
    if not axes or rows % math.prod(mesh.shape[a] for a in axes):
        return replicated(mesh)
    return NamedSharding(mesh, PartitionSpec(axes, *([None] * (ndim - 1))))


def put_batch(x: np.ndarray, mesh: Mesh, rules: Rules = TRAIN_RULES) -> jax.Array:
    """A global array from a host array that every process holds in full (rows as
    `batch_sharding`, a scalar replicated); each process hands JAX only its devices' slices."""
    x = np.asarray(x)
    where = batch_sharding(mesh, x.shape[0], x.ndim, rules) if x.ndim else replicated(mesh)
    return jax.make_array_from_callback(x.shape, where, lambda index: x[index])


def put_whole(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A global array whole on every device of ``mesh`` from a host array that every process
    holds."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, replicated(mesh), lambda index: x[index])


def to_host(x) -> np.ndarray:
    """The whole value of a (possibly multi-host) array on this host."""
    if isinstance(x, np.ndarray) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def allgather_bytes(blob: bytes) -> list[bytes]:
    """Every process's ``blob``, in process order (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [blob]
    sizes = multihost_utils.process_allgather(np.asarray([len(blob)], np.int32)).reshape(-1)
    buf = np.zeros(max(int(sizes.max()), 1), np.uint8)
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    blobs = np.asarray(multihost_utils.process_allgather(buf))
    return [blobs[p, : int(n)].tobytes() for p, n in enumerate(sizes)]
