"""Where a run's rollouts are sampled: the learner's own devices, or devices of the sampler's own.

With ``mesh.sampler_devices = N`` the sampler owns the slice's last N devices as a mesh of its
own (``checks.sampler_mesh_shape``) and holds its own copy of the weights there: the frozen
ones placed once, the trainable ones moved after every update (``place``: LoRA adapters alone
under LoRA), a resharding transfer from the learner's layout to the sampler's. Without it the
sampler runs the learner's graph on the learner's mesh, and ``place`` copies the trainable
params there, so that a batch sampled in flight keeps weights the next update cannot donate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from jaxgrpo.core import sharding


@dataclasses.dataclass
class SamplerSide:
    """The sampler's mesh, the graph it runs (its activations constrained on that mesh), the
    frozen weights there and the shardings the trainable params take there."""

    mesh: Any
    graphdef: Any
    frozen: Any
    param_sh: Any
    own_devices: bool
    copy: Any = None  # on the learner's devices: its jitted copy (out_shardings = param_sh)

    @classmethod
    def shared(cls, programs) -> SamplerSide:
        """The learner's devices: its graph, frozen weights and parameter shardings."""
        p = programs
        return cls(p.mesh, p.graphdef, p.frozen, p.param_sh, own_devices=False, copy=p.copy)

    @classmethod
    def own(cls, programs, mesh, params) -> SamplerSide:
        """Devices of the sampler's own (``mesh``): the graph re-split with its sharding
        context on ``mesh`` and the frozen weights moved there once. ``params`` are any
        version of the trainable params (for their tree)."""
        graphdef, trainable, frozen, rules = resplit_on(programs, mesh, params, programs.frozen)
        param_sh = sharding.param_shardings(trainable, mesh, rules)
        frozen_sh = sharding.param_shardings(frozen, mesh, rules)
        return cls(mesh, graphdef, jax.device_put(frozen, frozen_sh), param_sh, own_devices=True)

    def place(self, params):
        """A copy of the trainable ``params`` on the sampler's devices, in its layout."""
        if self.own_devices:
            return jax.device_put(params, self.param_sh)
        return self.copy(params)

    def weight_bytes(self, params) -> int:
        """Bytes ``place`` moves: the trainable params."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def resplit_on(programs, mesh, params, frozen) -> tuple[Any, Any, Any, Any]:
    """(graph, trainable, frozen, rules): the policy re-split with its sharding context on
    ``mesh`` (its activations constrained there), split as ``programs`` splits it; the leaves
    are ``params`` and ``frozen`` as given (real or abstract)."""
    model = nnx.merge(programs.graphdef, params, frozen)
    rules = model.shard_ctx.rules if model.shard_ctx is not None else sharding.TRAIN_RULES
    model.shard_ctx = sharding.ShardingCtx(mesh, rules)
    filters = (nnx.LoRAParam, nnx.Param) if programs.lora else (nnx.Param, ...)
    graphdef, trainable, frozen = nnx.split(model, *filters)
    return graphdef, trainable, frozen, rules
