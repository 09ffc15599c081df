"""The one place that builds a `Transformer`: abstractly, with random weights, or empty
(placeholders for a checkpoint to fill), on the host or already sharded over a mesh.

Nothing here compiles: shapes come from ``nnx.eval_shape`` and values are drawn (or zeroed)
by numpy one tensor at a time, then placed shard by shard with
``jax.make_array_from_callback``, so each host only ever holds its own shards.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo.core import sharding
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.lora import LoRA
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.models.weights import adoptable_empty


def abstract_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """The model's structure with ``jax.ShapeDtypeStruct`` leaves: no memory, no compile."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))


def random_model(
    cfg: ModelConfig, seed: int = 0, std: float = 0.05, mesh: Mesh | None = None, rules=None
) -> Transformer:
    """A Transformer with random weights drawn by numpy on the host: nothing is compiled.

    Eager nnx construction compiles each initialiser separately, which dominates small-model
    time on CPU. With a mesh, each tensor is created already sharded (``rules``, default
    ``TRAIN_RULES``) and placed shard by shard, and the model carries the ``ShardingCtx`` so
    its activations are constrained with the same mesh and rules. See `random_state` for the
    distribution.
    """
    if mesh is None:
        model = abstract_model(cfg, seed)
        nnx.update(model, random_state(nnx.state(model), seed, std))
        return model
    rules = rules or sharding.TRAIN_RULES
    graphdef, state = nnx.split(abstract_model(cfg, seed))
    shardings = sharding.param_shardings(state, mesh, rules)
    model = nnx.merge(graphdef, random_state(state, seed, std, shardings=shardings))
    model.shard_ctx = sharding.ShardingCtx(mesh, rules)
    return model


def random_state(abstract_state, seed: int = 0, std: float = 0.05, shardings=None):
    """Host-drawn values for an abstract model state, one tensor at a time.

    Norm scales are 1 + noise, LoRA B is zero (adapters start as the identity), everything
    else is normal(0, std). With `shardings` (a matching tree of NamedSharding), each tensor is
    placed shard by shard with `jax.make_array_from_callback`, so no compilation is needed.
    """
    rng = np.random.default_rng(seed)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def draw(path, var, sharding=None):
        value = var.get_value()
        name = str(getattr(path[-1], "key", path[-1]))
        x = adoptable_empty(value.shape, value.dtype)  # placed without a copy on CPU
        if name == "lora_b":
            x[...] = 0
        elif name == "scale":
            x[...] = 1.0 + 0.1 * rng.standard_normal(value.shape)
        else:
            x[...] = std * rng.standard_normal(value.shape)
        if sharding is None:
            return var.replace(jax.device_put(x))
        return var.replace(jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]))

    if shardings is None:
        return jax.tree_util.tree_map_with_path(draw, abstract_state, is_leaf=is_var)
    shardings = jax.tree.map(lambda v: v.get_value(), shardings, is_leaf=is_var)
    return jax.tree_util.tree_map_with_path(draw, abstract_state, shardings, is_leaf=is_var)


def empty_model(cfg: ModelConfig, seed: int = 0, mesh=None, rules=None) -> Transformer:
    """A Transformer whose base weights are placeholders for the checkpoint to fill.

    Base weights are ``jax.ShapeDtypeStruct`` leaves (with their ``NamedSharding`` under a
    mesh), so nothing is allocated until ``load_hf_tensors`` places each tensor family where it
    belongs: a load holds one copy of the weights, not a second one of zeros (zero arrays placed
    on a CPU device are written out in full). Initialising random weights only to discard them
    would also cost a compilation per ``jax.random`` draw. LoRA adapters are real values, drawn
    by numpy with ``LoRA.__init__``'s distribution (A ~ N(0, 1 / fan_in), B = 0) and placed in
    their sharding under a mesh (host arrays otherwise).
    """
    model = abstract_model(cfg, seed)
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LoRA):
            a, b = node.lora_a, node.lora_b
            fan_in = math.prod(a.shape[a.ndim - node.n_in - 1 : -1])
            a_init = rng.standard_normal(a.shape, np.float32) / np.float32(math.sqrt(fan_in))
            a.set_value(a_init.astype(a.dtype))
            b.set_value(np.zeros(b.shape, b.dtype))
    if mesh is None:
        return model
    rules = rules or sharding.TRAIN_RULES
    graphdef, state = nnx.split(model)
    shardings = sharding.param_shardings(state, mesh, rules)

    def place(x, where):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
        return jax.device_put(x, where)

    model = nnx.merge(graphdef, jax.tree.map(place, state, shardings))
    model.shard_ctx = sharding.ShardingCtx(mesh, rules)
    return model
