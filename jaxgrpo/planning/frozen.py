"""Second models on a slice, for the ahead-of-time compile: reward models' scoring programs
with abstract, sharded arguments, and what each program leaves resident on the chips.

A run's frozen second models (``memory.second_models``: a distillation teacher, reward models)
keep their weights on every chip for the whole run. A program's own memory analysis counts
only its arguments, so the report adds, per program, the persistent bytes of the other models
(``resident_bytes``): the second models' weights beside the policy's programs, and the
policy's state beside a second model's program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.models.classifier import abstract_classifier, classifier_config, scoring_program
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.planning import flops
from jaxgrpo.planning.memory import reward_model_sources
from jaxgrpo.rewards.reward_model import DEFAULT_BATCH_SIZE, DEFAULT_MAX_LENGTH
from jaxgrpo.rl.programs import abstract_array


def per_chip_bytes(tree) -> float:
    """Bytes one device holds of a tree of sharded arrays or ``jax.ShapeDtypeStruct``s."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        total += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class ScoringCall:
    """One reward model's scoring program, ready to lower: what
    ``program.compile_program`` takes.

    Attributes:
      name: the program's name in the report (``score (reward_model[i])``).
      owner: the memory part its weights are (``reward_model[i]``).
      jitted / args: the program and its abstract arguments (state, ids [B, T], mask [B, T]).
      calls: scoring calls per step (the step's sequences, ``batch_size`` rows at a time).
      flops: (hardware, model) FLOPs of one call, whole slice.
      weight_bytes: weight bytes per chip one call reads.
    """

    name: str
    owner: str
    jitted: Any
    args: tuple
    calls: int
    flops: tuple[float, float]
    weight_bytes: float


def reward_model_calls(cfg: Any, mesh, fields: dict, text_len: int, rows: int) -> list:
    """A ``ScoringCall`` for each reward model of ``cfg.rewards.functions``.

    Args:
      cfg: the run's ``TrainConfig``.
      mesh: the slice's mesh.
      fields: ``ModelConfig`` fields of the policy (dtype, param_dtype, layout).
      text_len: tokens of a prompt and its completion (the reward model's text).
      rows: sequences a step scores.
    """
    out = []
    for i, source in reward_model_sources(cfg).items():
        options = cfg.rewards.functions[i][2] if len(cfg.rewards.functions[i]) > 2 else {}
        batch_size = options.get("batch_size", DEFAULT_BATCH_SIZE)
        b = bucket_length(min(batch_size, rows), 1, batch_size)  # as `RewardModel` pads one
        t = bucket_length(min(text_len, options.get("max_length", DEFAULT_MAX_LENGTH)))
        rm_cfg = classifier_config(source, **fields)
        model = abstract_classifier(rm_cfg)
        model.backbone.shard_ctx = sharding.ShardingCtx(mesh, sharding.TRAIN_RULES)
        state = nnx.split(model)[1]
        shardings = sharding.param_shardings(state, mesh, sharding.TRAIN_RULES)
        state = jax.tree.map(abstract_array, state, shardings)
        ids = abstract_array(np.zeros((b, t), np.int32), sharding.batch_sharding(mesh, b, 2))
        backbone = rm_cfg.backbone
        f = (flops.prefill(backbone, b, t),) * 2
        name = f"reward_model[{i}]"
        out.append(
            ScoringCall(
                f"score ({name})",
                name,
                scoring_program(model, mesh),
                (state, ids, ids),
                math.ceil(rows / b),
                f,
                flops.weight_bytes(backbone) / mesh.size,
            )  # fmt: skip
        )
    return out


def set_resident(programs: list, persistent: dict[str, float]) -> None:
    """Sets each program's ``resident_bytes``: the persistent bytes per chip of every model
    but its ``owner`` (``persistent``: owner -> bytes; "policy" owns the step's own)."""
    total = sum(persistent.values())
    for program in programs:
        program.resident_bytes = total - persistent[program.owner]
