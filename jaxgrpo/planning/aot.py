"""Ahead-of-time compilation of a GRPO step's programs for a slice that is not here.

``jaxgrpo.planning.compile`` is the command line; this module does the work. A ``Learner`` is
built on an abstract model (``nnx.eval_shape``: shapes and shardings, no weights) over the target
slice's devices (a TPU topology description from libtpu, or virtual CPU devices), and the very
jitted functions the trainer calls are lowered with sharded ``jax.ShapeDtypeStruct``
arguments and compiled: the sampler's prefill and decode loop, the scoring pass (reference and
old policy), the update, evaluation's greedy sampler and, with tools, the sampler of later
turns. Each compiled program is read for its memory (``memory_analysis``), its collectives
(from the HLO text, per while-loop body and weighted by trip counts) and compile time; FLOPs
are counted analytically (``flops``), since XLA's cost analysis counts a loop body once.

With ``mesh.sampler_devices`` = N the sampler's programs (``jaxgrpo.planning.sampler_aot``)
are lowered on a mesh of the slice's last N devices, over the sampler's own copy of the
weights, and the learner's on the rest; each program says its side and how many devices it
spans.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.agents import Agent
from jaxgrpo.core import presets, sharding
from jaxgrpo.core.host import FORCE_HOST_DEVICES_FLAG
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.planning import flops, frozen, memory
from jaxgrpo.planning.program import Program, compile_program
from jaxgrpo.planning.sampler_aot import SamplerCopy, continuation_programs, generate_programs
from jaxgrpo.rl import held_out
from jaxgrpo.rl.learner import Learner
from jaxgrpo.settings.checks import sampler_mesh_shape
from jaxgrpo.settings.model import model_config

# Characters per token of the tools' description (no model tokenizer is loaded): a large-vocab
# tokenizer's rate on JSON and English (Llama 3's 128k; SmolLM2's 49k takes 3.6 on the python tool).
TOOL_CHARS_PER_TOKEN = 4
# The programs' name prefixes on each side (``--only``'s words).
SAMPLER, LEARNER = ("sample", "continue", "eval"), ("score", "update")


def topology_devices(preset: presets.Preset) -> list:
    """The devices of ``preset``: a libtpu topology description, or this process's CPUs."""
    if preset.topology is None:
        devices = jax.devices()
        if len(devices) < preset.devices:
            raise ValueError(
                f"{preset.name} needs {preset.devices} devices, have {len(devices)}: set "
                f"XLA_FLAGS={FORCE_HOST_DEVICES_FLAG}={preset.devices} first"
            )
        return devices[: preset.devices]
    from jax.experimental import topologies  # needs libtpu: only for TPU targets

    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=preset.topology,
        chip_config_name="megacore" if preset.chip == "v4" else "default",
        chips_per_host_bounds=preset.chips_per_host,
        num_slices=1,
    )
    return list(desc.devices)


def abstract_model(model_cfg: ModelConfig, mesh) -> Transformer:
    """A ``Transformer`` of abstract, sharded parameters (``nnx.eval_shape``): no weights."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    model.shard_ctx = sharding.ShardingCtx(mesh, sharding.TRAIN_RULES)
    return model


def abstract_learner(
    cfg: Any, mesh, model_cfg: ModelConfig, others: dict[str, ModelConfig] | None = None
) -> Learner:
    """A ``Learner`` over an abstract, sharded model (and teacher, from ``others``,
    ``memory.second_models``): its programs lower, nothing runs."""
    others = others or {}
    teacher = abstract_model(others["teacher"], mesh) if "teacher" in others else None
    tok, task = tiny_tokenizer(), SimpleNamespace(name="abstract")
    agent = Agent.from_config(cfg.agent, tok)
    return Learner(cfg, abstract_model(model_cfg, mesh), tok, task, None, mesh, agent, teacher)


def tool_prompt_tokens(agent: Agent | None) -> int:
    """Tokens the tools' description adds to a prompt at ``TOOL_CHARS_PER_TOKEN`` (0: none)."""
    return 0 if agent is None else math.ceil(agent.prompt_chars / TOOL_CHARS_PER_TOKEN)


def _rollout_programs(copy: SamplerCopy, learner: Learner, p: int, t: int, want) -> list:
    """The sampler's programs of a step on ``copy``: the rollouts' prefill and decode and,
    with tools, the later turns' (``continue``)."""
    rl = learner.rl
    episodes = learner.keeps_cache  # an episode's later turns continue each call's cache
    if not (want("sample") or (episodes and want("continue"))):
        return []
    settings = dataclasses.replace(learner.sampler_settings(0), keep_cache=episodes)
    programs, first_turn = generate_programs(copy, "sample", rl.prompts_per_step, p, settings)
    programs = programs if want("sample") else []
    if episodes and want("continue") and first_turn is not None:
        programs += continuation_programs(copy, learner, p, t, first_turn)
    return programs


def _learner_programs(learner: Learner, p: int, t: int, want) -> tuple[list, dict]:
    """The learner's programs of a step (scoring passes, reward models, the update), and the
    persistent bytes per chip of each model on its mesh (``frozen.set_resident``)."""
    step, rl = learner.programs, learner.rl
    cfg = step.model_cfg
    b, n, d = rl.prompts_per_step, rl.prompts_per_step * rl.group_size, learner.mesh.size
    programs = []
    batch = step.abstract_batch(p, t)
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask, batch.temps)
    score = (step.params0, step.frozen, *inputs, batch.packing, batch.shared_ids)
    passes = int(step.needs_ref) + int(step.old_from == "forward")
    w = flops.weight_bytes(cfg) / d
    if passes and want("score"):
        f = (flops.score(cfg, b, p, n, t),) * 2
        programs.append(compile_program("score (ref/old)", step.logprobs, score, passes, f, w))
    if step.teacher_logprobs is not None and want("score"):
        teacher = step.teacher_model_cfg
        f = (flops.score(teacher, b, p, n, t),) * 2
        args = (*step.teacher_weights, *inputs, batch.packing, batch.shared_ids)
        w_teacher = flops.weight_bytes(teacher) / d
        programs.append(
            compile_program("score (teacher)", step.teacher_logprobs, args, 1, f, w_teacher)
        )
        programs[-1].owner = "teacher"
    persistent = {"policy": frozen.per_chip_bytes((step.abstract_state(), step.frozen))}
    if step.teacher_weights is not None:
        persistent["teacher"] = frozen.per_chip_bytes(step.teacher_weights)
    fields = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, layout=cfg.layout)
    for call in frozen.reward_model_calls(learner.cfg, learner.mesh, fields, p + t, n):
        persistent[call.owner] = frozen.per_chip_bytes(call.args[0])
        if want("score"):
            args = (call.name, call.jitted, call.args, call.calls, call.flops, call.weight_bytes)
            programs.append(compile_program(*args))
            programs[-1].owner = call.owner
    if want("update"):
        u = step.micro_batches(batch)
        idx = jax.ShapeDtypeStruct(
            (u, b // (rl.num_minibatches * u)), jnp.int32, sharding=step.replicated
        )
        shape = (b // rl.num_minibatches, p, n // rl.num_minibatches, t)
        f = flops.update(cfg, *shape), flops.update(cfg.replace(remat=False), *shape)
        args = (step.abstract_state(), step.frozen, batch, idx)
        calls = rl.ppo_epochs * rl.num_minibatches
        programs.append(compile_program("update", step.update, args, calls, f, 3 * w))
    return programs, persistent


def _step_programs(learner: Learner, copy: SamplerCopy, p: int, t: int, wanted) -> list:
    """Compiles the step's programs whose names start with one of ``wanted`` (None: all):
    the sampler's on ``copy`` (its own devices, or the learner's), the rest on the
    learner's mesh; and sets what stays resident beside each.

    A lagging sampler (``rl.max_staleness`` = k >= 1) keeps k versions of the trainable
    params: on the learner's devices all k beside the learner's state; on its own devices
    k - 1 beside the one its programs take as an argument, and the frozen weights.
    """
    want = lambda name: wanted is None or name.startswith(tuple(wanted))  # noqa: E731
    k, own = learner.rl.max_staleness, copy.mesh is not learner.mesh
    sampled = _rollout_programs(copy, learner, p, t, want)
    scored, persistent = _learner_programs(learner, p, t, want)
    if want("eval"):
        settings = held_out.sampler_settings(learner)
        n = learner.rl.prompts_per_step * learner.rl.group_size
        sampled += generate_programs(copy, "eval", n, p, settings)[0]
    trainable = frozen.per_chip_bytes(copy.params)
    for program in sampled:
        program.side, program.devices = "sampler", copy.mesh.size
    for program in scored:
        program.devices = learner.mesh.size
    if own:
        weights = frozen.per_chip_bytes((copy.params, copy.frozen))
        frozen.set_resident(sampled, {"policy": weights, "versions": (k - 1) * trainable})
        frozen.set_resident(scored, persistent)
    else:
        frozen.set_resident(sampled + scored, {**persistent, "versions": k * trainable})
    # The step's order: rollouts, scoring and the update, then evaluation (compiled last).
    rollouts = [x for x in sampled if not x.name.startswith("eval/")]
    return rollouts + scored + sampled[len(rollouts) :]


def compile_step(
    cfg: Any, preset: presets.Preset, prompt_len: int, only: tuple[str, ...] | None = None
) -> tuple[list[Program], dict]:
    """Compiles the programs of one training step of ``cfg`` on ``preset``'s slice.

    With ``mesh.sampler_devices`` = N the learner's mesh takes the slice's first devices and
    the sampler's (``checks.sampler_mesh_shape``) the last N, with its copy of the weights
    (``SamplerCopy.own``).

    Args:
      cfg: the run's ``TrainConfig`` (its mesh resolved for the slice).
      preset: the slice.
      prompt_len: longest prompt in tokens, without the tools' description, which is added
        (``tool_prompt_tokens``); the prompt bucket is their sum's ``bucket_length``.
      only: name prefixes of the programs to compile (``"sample"``, ``"continue"``,
        ``"score"``, ``"update"``, ``"eval"``); None compiles all.

    Returns:
      (programs, facts): facts hold the meshes, model shape and what the learner decided.
    """
    devices = topology_devices(preset)
    platform = devices[0].platform
    n = cfg.mesh.sampler_devices
    shape = {k: getattr(cfg.mesh, k) for k in ("data", "fsdp", "tensor")}
    mesh = sharding.make_mesh(shape, devices[: len(devices) - n])
    model_cfg = model_config(cfg.model, platform)
    others = memory.second_models(cfg, platform)
    learner = abstract_learner(cfg, mesh, model_cfg, others)
    copy = SamplerCopy.shared(learner.programs)
    if n:
        own = sharding.make_mesh(sampler_mesh_shape(cfg, dict(mesh.shape)), devices[-n:])
        for side, side_mesh, names in (("learner", mesh, LEARNER), ("sampler", own, SAMPLER)):
            if only is None or any(x.startswith(tuple(only)) for x in names):
                _check_part_of_slice(side, side_mesh, preset)
        copy = SamplerCopy.own(learner.programs, own)
    tool_tokens = tool_prompt_tokens(learner.agent)
    p, t = bucket_length(prompt_len + tool_tokens), cfg.sampling.max_new_tokens
    programs = _step_programs(learner, copy, p, t, only)
    facts = _facts(cfg, preset, devices, learner, copy, model_cfg, others)
    facts.update(prompt_len=p, tool_prompt_tokens=tool_tokens, max_new_tokens=t)
    return programs, facts


def _check_part_of_slice(side: str, mesh, preset: presets.Preset) -> None:
    """Refuses, in one line, a side whose devices the compiler will not take as a program's:
    XLA:TPU on chips with limited ICI routing refuses some programs over part of a slice (on
    v5e-32 and v5e-64 any that includes the slice's first chip). A one-row sum over the mesh
    asks it in well under a second, before the step's programs take minutes."""
    x = jax.ShapeDtypeStruct(
        (mesh.size, 128), jnp.float32, sharding=sharding.batch_sharding(mesh, mesh.size, 2)
    )
    try:
        jax.jit(lambda a: a.sum(0)).lower(x).compile()
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).splitlines()[0]
        raise ValueError(
            f"mesh.sampler_devices: the compiler refuses a program over the {side}'s "
            f"{mesh.size} of {preset.name}'s {preset.devices} chips ({reason}): set "
            "mesh.sampler_devices=0 (rl.max_staleness alone keeps the lag), or use a slice "
            "that takes programs over part of it (v5p)"
        ) from None


def _facts(cfg, preset, devices, learner, copy, model_cfg, others) -> dict:
    """What the report says of the run besides its programs."""
    sources = memory.second_model_sources(cfg)
    rules = sharding.sampling_rules(copy.mesh, flops.weight_bytes(model_cfg))
    k = cfg.rl.max_staleness
    facts = dict(
        topology=preset.name,
        platform=devices[0].platform,
        devices=len(devices),
        hosts=len({dev.process_index for dev in devices}),
        mesh=dict(learner.mesh.shape),
        model=cfg.model.source,
        params=memory.base_param_count(model_cfg),
        lora_params=memory.lora_param_count(model_cfg),
        tuning="LoRA" if model_cfg.lora else "full",
        sample_rules=sharding.rules_name(rules),
        updates_per_step=learner.programs.updates_per_step,
        old_logp=learner.programs.old_from,
        remat=model_cfg.remat,
        remat_policy=model_cfg.remat_policy,
        layer_loop=model_cfg.layout.layer_loop,
        second_models={
            name: {"source": sources[name][1], "params": memory.base_param_count(m)}
            for name, m in others.items()
        },
        max_staleness=k,
        trainable_bytes_per_chip=frozen.per_chip_bytes(learner.programs.params0),
    )
    if copy.mesh is not learner.mesh:
        sampler_devices = list(copy.mesh.devices.flat)
        facts["sampler"] = dict(
            devices=copy.mesh.size,
            mesh=dict(copy.mesh.shape),
            hosts=len({dev.process_index for dev in sampler_devices}),
            device_ids=sorted(dev.id for dev in sampler_devices),
            trainable_bytes_per_chip=frozen.per_chip_bytes(copy.params),
            frozen_bytes_per_chip=frozen.per_chip_bytes(copy.frozen),
        )
        facts["learner_devices"] = learner.mesh.size
        facts["transfer_bytes"] = sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(learner.programs.params0)
        )
    return facts
