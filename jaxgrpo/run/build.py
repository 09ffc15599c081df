"""The parts of a run built from its config: mesh, model and tokenizer, task, rewards, and a
run's trained policy from its checkpoint.

Training (``jaxgrpo.run.train``), evaluation (``jaxgrpo.eval``) and export (``jaxgrpo.run.export``)
all build through here, so none of them imports another's command line.

Model sources: ``load_source`` (the public ``jaxgrpo.load_model``) takes every source that
``jaxgrpo.models.load_model`` takes (Hugging Face directory or hub id, ``.gguf``,
``random:<name>``, ``"smollm2"``, ``"tiny"``) and a jaxgrpo run directory, whose latest
checkpoint is rebuilt here (it needs the run's config and learner state, which lie above
``jaxgrpo.models``) and handed down with its LoRA merged into the weights. ``build_model`` (a
run's policy) and ``build_frozen_model`` (a second model that is not trained) go through it,
so a source means the same in the library and in every command line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
from etils import epath
from flax import nnx
from jax.sharding import Mesh

import jaxgrpo.models.lora as lora_lib
from jaxgrpo.agents import Agent
from jaxgrpo.core import sharding
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.core.host import initialize_distributed
from jaxgrpo.data import TASKS, get_task
from jaxgrpo.data.base import Task
from jaxgrpo.models import Checkpoint, load_model
from jaxgrpo.models.aliases import MODEL_ALIASES
from jaxgrpo.models.classifier import CheckpointError
from jaxgrpo.models.layout import mesh_platform
from jaxgrpo.models.tokenizer import check_same_tokenizer
from jaxgrpo.models.weights import hf_tensors
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rewards.perplexity import make_perplexity_reward
from jaxgrpo.rewards.reward_model import is_model_source, load_reward_model
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.rl.learner import Learner
from jaxgrpo.settings.checks import sampler_mesh_shape
from jaxgrpo.settings.loading import is_run_dir, run_config
from jaxgrpo.settings.model import model_fields
from jaxgrpo.settings.schema import (
    ModelSpec,
    RewardsConfig,
    TaskConfig,
    TrainConfig,
    resolve_mesh_shape,
)


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
    """The learner's device mesh of ``cfg.mesh``: over every device (a -1 axis filled), or
    over all but the last ``mesh.sampler_devices``."""
    return build_meshes(cfg)[0]


def build_meshes(cfg: TrainConfig) -> tuple[Any, Any]:
    """(the learner's mesh, the sampler's own mesh or None): with ``mesh.sampler_devices =
    N`` the sampler owns the slice's last N devices (``checks.sampler_mesh_shape``)."""
    devices, n = jax.devices(), cfg.mesh.sampler_devices
    shape = resolve_mesh_shape(cfg, len(devices))
    if n == 0:
        return sharding.make_mesh(shape, devices), None
    learner = sharding.make_mesh(shape, devices[: len(devices) - n])
    sampler = sharding.make_mesh(sampler_mesh_shape(cfg, shape), devices[len(devices) - n :])
    return learner, sampler


def load_source(source, dtype="float32", lora=None, mesh=None, rules=None, **kwargs):
    """(model, tokenizer) of any model source: ``jaxgrpo.models.load_model``'s, or a jaxgrpo
    run directory (``trained_checkpoint``), whose merged weights get fresh adapters when
    ``lora`` asks for them, so training can continue from a run. This is ``jaxgrpo.load_model``.

    Arguments, return value and errors as ``jaxgrpo.models.load_model``'s; a run directory
    also raises as ``trained_checkpoint`` does.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path not in MODEL_ALIASES and is_run_dir(path):
            source = trained_checkpoint(path, mesh)
    return load_model(source, dtype, lora, mesh, rules, **kwargs)


def build_model(spec: ModelSpec, seed: int, mesh: Any = None):
    """(model, tokenizer) for ``spec.source`` (any source ``load_source`` takes), with LoRA
    adapters when ``lora_rank > 0`` and the layout of the mesh's devices
    (``jaxgrpo.settings.model``)."""
    return load_source(spec.source, mesh=mesh, seed=seed, **model_fields(spec, mesh_platform(mesh)))


def build_frozen_model(source: str, mesh: Any, *, dtype: str, param_dtype: str, seed: int = 0):
    """(model, tokenizer) of a second model that is never trained (a distillation teacher):
    any source ``load_source`` takes, without LoRA or remat, its weights sharded over ``mesh``
    by the rules the policy's use."""
    spec = ModelSpec(
        source=source,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=False,
        remat_policy="full",
        layer_loop="auto",
        lora_rank=0,
        lora_alpha=0.0,
        lora_targets=(),
    )
    return build_model(spec, seed, mesh)


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


def bind_model_rewards(
    specs: Sequence[tuple], model: Any, tokenizer: Any, mesh: Mesh | None = None
) -> list[tuple]:
    """Binds the frozen base model to model-based rewards (``perplexity``) and loads the reward
    models the specs name (``reward_model.is_model_source``) on ``mesh``, in the policy's dtypes.

    Built now, before training touches anything: the reward snapshots the weights, and a fresh
    model's LoRA B is zero, so it scores under the base policy for the whole run.

    Raises:
      ConfigError: a reward model that cannot be loaded, naming its ``rewards.functions`` entry.
    """
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec[0], str) and is_model_source(spec[0]):
            cfg = getattr(model, "cfg", None)
            dtypes = {} if cfg is None else dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
            options = spec[2] if len(spec) > 2 else {}
            try:
                scorer = load_reward_model(spec[0], mesh=mesh, **dtypes, **options)
            except CheckpointError as e:
                raise ConfigError(f"config key 'rewards.functions[{i}]': {e}") from None
            spec = (scorer, spec[1])
        elif spec[0] == "perplexity":
            scorer = make_perplexity_reward(model, tokenizer, **(spec[2] if len(spec) > 2 else {}))

            def perplexity(prompts, completions, _scorer=scorer, **columns):
                return _scorer(prompts, completions, **columns)

            spec = (perplexity, spec[1])
        out.append(spec)
    return out


def build_rewards(
    cfg: RewardsConfig,
    model: Any,
    tokenizer: Any,
    agent: Agent | None = None,
    mesh: Mesh | None = None,
) -> RewardSet:
    """The run's ``RewardSet``, model-based rewards bound to the (untrained) ``model`` and
    reward models loaded on ``mesh``, and the ``agent``'s environment's ``get_reward()`` as one
    more term, at its weight."""
    specs = bind_model_rewards(cfg.functions, model, tokenizer, mesh)
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
    mesh, sampler_mesh = build_meshes(cfg)
    # The data first: a missing file, row or package is reported in seconds, not after a load.
    task = build_task(cfg.task)
    task.eval_examples()
    model, tokenizer = build_model(cfg.model, cfg.seed, mesh)
    teacher = build_teacher(cfg, mesh, tokenizer)
    agent = Agent.from_config(cfg.agent, tokenizer)
    rewards = build_rewards(cfg.rewards, model, tokenizer, agent, mesh)
    learner = Learner(cfg, model, tokenizer, task, rewards, mesh, agent, teacher, sampler_mesh)
    return RunParts(learner, task, mesh)


def build_teacher(cfg: TrainConfig, mesh: Any, tokenizer: Any):
    """The run's frozen teacher on ``mesh`` in the policy's dtypes, or None when
    ``cfg.teacher`` uses none.

    Raises:
      ConfigError: the teacher's tokenizer is not the policy's (``tokenizer``): its ids would
        score other text than the policy sampled.
    """
    if not cfg.teacher.enabled:
        return None
    m = cfg.model
    teacher, teacher_tok = build_frozen_model(
        cfg.teacher.source, mesh, dtype=m.dtype, param_dtype=m.param_dtype, seed=cfg.seed
    )
    check_same_tokenizer(
        tokenizer, teacher_tok, policy_source=m.source, other_source=cfg.teacher.source
    )
    return teacher


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


def trained_checkpoint(run_dir: str, mesh: Any = None) -> Checkpoint:
    """Run ``run_dir``'s policy at its latest checkpoint, as an open ``Checkpoint`` in memory:
    LoRA merged into the base weights (for full fine-tuning, the trained weights), the run's
    tokenizer.

    The policy is rebuilt as the run built it (``load_policy``), on ``mesh`` or else the run's
    own mesh over this host's devices, merged in place and read out under Hugging Face names
    as an export writes it; ``load_model`` then builds whatever model the caller asks for.

    Raises:
      FileNotFoundError: the run saved no checkpoint (the message names the run directory).
      ConfigError: the run's ``model.source`` is the run directory itself.
    """
    cfg = run_config(None, run_dir, {})
    if os.path.abspath(cfg.model.source) == os.path.abspath(run_dir):
        raise ConfigError(f"model source {run_dir!r}: the run's own model.source is itself")
    if not (epath.Path(run_dir) / "checkpoints").exists():  # the Checkpointer would create it
        raise FileNotFoundError(f"model source {run_dir!r} is a run directory without checkpoints")
    model, tokenizer, _ = load_policy(cfg, run_dir, build_mesh(cfg) if mesh is None else mesh)
    tensors = hf_tensors(lora_lib.merge(model), merge_lora=False)
    return Checkpoint(run_dir, model.cfg.to_hf_config(), tensors.__getitem__, lambda: tokenizer)


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
