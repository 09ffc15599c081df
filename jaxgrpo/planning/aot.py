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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import time
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.agents import Agent
from jaxgrpo.agents.rollout import chunk_room
from jaxgrpo.core import presets, sharding
from jaxgrpo.core.host import FORCE_HOST_DEVICES_FLAG
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.planning import flops, frozen, memory
from jaxgrpo.rl import held_out
from jaxgrpo.rl.learner import Learner
from jaxgrpo.rl.programs import abstract_array
from jaxgrpo.sampling import sampler_programs
from jaxgrpo.sampling.resume import resume_programs
from jaxgrpo.settings.model import model_config

# Characters per token of the tools' description (no model tokenizer is loaded): a large-vocab
# tokenizer's rate on JSON and English (Llama 3's 128k; SmolLM2's 49k takes 3.6 on the python tool).
TOOL_CHARS_PER_TOKEN = 4


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


@dataclasses.dataclass
class Program:
    """One compiled program of the step and what the report says about it.

    Attributes:
      name: ``sample/prefill``, ``sample/decode``, ``reference``, ``update``, ...
      calls: times the step runs it (at most, for the sampler of later turns).
      compiled: the ``jax.stages.Compiled``.
      lower_s / compile_s: seconds to lower and to compile.
      flops: analytic FLOPs of one call, whole slice (with remat's recomputation).
      model_flops: the same without recomputation (what MFU counts).
      weight_bytes: parameter bytes per chip read by one call (roofline estimate).
      loop_trips: trip count assumed for while loops XLA cannot count (the decode loop: T).
      oom: the compiler's message when it refused the program for exceeding the chip's
        memory (``compiled`` is then None).
      owner: whose weights it runs: "policy", "teacher" or "reward_model[i]".
      resident_bytes: bytes per chip that stay on the device while it runs but are not its
        arguments (``frozen.set_resident``): a second model's weights beside the policy's
        programs, the policy's state beside the second model's.
    """

    name: str
    calls: int
    compiled: Any
    lower_s: float
    compile_s: float
    flops: float
    model_flops: float
    weight_bytes: float
    loop_trips: int = 1
    oom: str | None = None
    owner: str = "policy"
    resident_bytes: float = 0.0


def _compile(name, jitted, args, calls, flops, weight_bytes, loop_trips=1, kwargs=None) -> Program:
    """Lowers and compiles ``jitted`` on ``args`` (and static ``kwargs``); ``flops`` is
    (hardware, model) FLOPs."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **(kwargs or {}))
    mid = time.perf_counter()
    oom = None
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program that cannot fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        compiled, oom = None, str(e)
    end = time.perf_counter()
    logging.info("compiled %s in %.1f s (lowered in %.1f s)", name, end - mid, mid - start)
    return Program(
        name, calls, compiled, mid - start, end - mid, *flops, weight_bytes, loop_trips, oom
    )


_OOM = re.compile(
    r"required for ([\w ]+?) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)


def oom_bytes(message: str) -> tuple[int, int]:
    """(bytes needed, bytes available) from XLA:TPU's out-of-memory message; (0, 0) when
    the message says neither."""
    m = _OOM.search(message)
    if not m:
        return 0, 0
    size = lambda x, unit: int(float(x) * 1024 ** ("KMGT".index(unit) + 1))  # noqa: E731
    return size(m.group(2), m.group(3)), size(m.group(4), m.group(5))


def _knobs(knobs, replicated):
    return jax.tree.map(lambda x: abstract_array(x, replicated), knobs)


def tool_prompt_tokens(agent: Agent | None) -> int:
    """Tokens the tools' description adds to a prompt at ``TOOL_CHARS_PER_TOKEN`` (0: none)."""
    return 0 if agent is None else math.ceil(agent.prompt_chars / TOOL_CHARS_PER_TOKEN)


def _sampler(learner, name, prompts, prompt_len, settings, devices, calls=1) -> tuple[list, Any]:
    """Compiles one ``generate_from_state`` call's prefill and decode, run ``calls`` times;
    and the decode's abstract output (None if it did not fit)."""
    step, mesh = learner.programs, learner.mesh
    cfg = step.model_cfg
    ids = abstract_array(
        np.zeros((prompts, prompt_len), np.int32), sharding.batch_sharding(mesh, prompts, 2)
    )
    prefill, decode, knobs = sampler_programs(step.graphdef, cfg, ids, settings)
    knobs = _knobs(knobs, step.replicated)
    states = (step.params0, step.frozen)
    n, t = prompts * settings.num_samples, settings.max_new_tokens
    f = flops.prefill(cfg, prompts, prompt_len), flops.decode(cfg, n, prompt_len, t)
    f = (f[0], f[0]), (f[1], f[1])
    w = flops.weight_bytes(cfg) / devices
    args = (states, ids, ids, knobs, _rng(step))
    first = _compile(f"{name}/prefill", prefill, args, calls, f[0], w)
    state = jax.eval_shape(prefill, *args)
    second, out = _decode(learner, name, decode, first, state, knobs, calls, f[1], t)
    return [first, second], out


def _rng(step):
    """The abstract PRNG key of a sampler call, replicated."""
    return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=step.replicated)


def _decode(learner, name, decode, first, state, knobs, calls, f, t) -> tuple[Program, Any]:
    """The decode program after ``first`` (a prefill or a later turn's resume, whose abstract
    output is ``state``), and its own abstract output."""
    step, mesh = learner.programs, learner.mesh
    if first.compiled is not None:
        state = jax.tree.map(abstract_array, state, first.compiled.output_shardings)
    else:  # prefill did not fit: rows over data x fsdp, as the compiler would place them
        rows = lambda x: (
            sharding.batch_sharding(mesh, x.shape[0], x.ndim) if x.ndim else step.replicated
        )  # noqa: E731
        state = jax.tree.map(lambda x: abstract_array(x, rows(x)), state)
    decode_w = flops.weight_bytes(step.model_cfg) / mesh.shape["tensor"] * t  # once per token
    states = (step.params0, step.frozen)
    second = _compile(f"{name}/decode", decode, (states, state, knobs), calls, f, decode_w, t)
    out = None
    if second.compiled is not None:
        out = jax.eval_shape(decode, states, state, knobs)
        out = jax.tree.map(abstract_array, out, second.compiled.output_shardings)
    return second, out


def _continuation(learner: Learner, p: int, t: int, first_turn: Any) -> list[Program]:
    """Compiles the sampler of an episode's later turns (``jaxgrpo.agents.rollout``) at its
    largest: every row calls a tool (padded as there), each continued from the first turn's
    kept cache (``first_turn``, the decode's abstract output) with up to T - 1 earlier ids and
    the widest appended chunk (``chunk_room``: its last kept id and results), then one sample
    with its own budget."""
    rl, mesh, step = learner.rl, learner.mesh, learner.programs
    rows = bucket_length(rl.prompts_per_step * rl.group_size, 1)
    rows += -rows % (mesh.shape["data"] * mesh.shape["fsdp"])
    settings = dataclasses.replace(
        learner.sampler_settings(0), max_lengths=np.full(rows, t, np.int32)
    )
    k = chunk_room(t)
    batch = lambda shape: abstract_array(  # noqa: E731
        np.zeros(shape, np.int32), sharding.batch_sharding(mesh, rows, len(shape))
    )
    ids = batch((rows, k))
    resume, decode, knobs = resume_programs(step.graphdef, step.model_cfg, ids, settings)
    knobs = _knobs(knobs, step.replicated)
    states, cache = (step.params0, step.frozen), first_turn.cache
    args = (states, cache, batch((rows,)), batch((rows,)), batch((rows,)), ids, ids, knobs)
    args += (_rng(step),)
    width = bucket_length(t - 1, 16)
    cfg, turns = step.model_cfg, learner.cfg.agent.max_turns - 1
    context = p + width + k
    f = (flops.prefill(cfg, rows, k),) * 2, (flops.decode(cfg, rows, context, t),) * 2
    w = flops.weight_bytes(cfg) / mesh.size
    kwargs = {"width": width, "room": ids.shape[1]}
    first = _compile("continue/resume", resume, args, turns, f[0], w, kwargs=kwargs)
    state = jax.eval_shape(functools.partial(resume, **kwargs), *args)
    return [first, _decode(learner, "continue", decode, first, state, knobs, turns, f[1], t)[0]]


def _step_programs(learner: Learner, p: int, t: int, wanted) -> list[Program]:
    """Compiles the step's programs whose names start with one of ``wanted`` (None: all)."""
    step, rl = learner.programs, learner.rl
    cfg = step.model_cfg
    b, n, d = rl.prompts_per_step, rl.prompts_per_step * rl.group_size, learner.mesh.size
    want = lambda name: wanted is None or name.startswith(tuple(wanted))  # noqa: E731
    programs = []
    episodes = learner.keeps_cache  # an episode's later turns continue each call's cache
    settings = dataclasses.replace(learner.sampler_settings(0), keep_cache=episodes)
    if want("sample") or (episodes and want("continue")):
        sampled, first_turn = _sampler(learner, "sample", b, p, settings, d)
        programs += sampled if want("sample") else []
    if episodes and want("continue") and first_turn is not None:
        programs += _continuation(learner, p, t, first_turn)
    batch = step.abstract_batch(p, t)
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask, batch.temps)
    score = (step.params0, step.frozen, *inputs, batch.packing, batch.shared_ids)
    passes = int(step.needs_ref) + int(step.old_from == "forward")
    w = flops.weight_bytes(cfg) / d
    if passes and want("score"):
        f = (flops.score(cfg, b, p, n, t),) * 2
        programs.append(_compile("score (ref/old)", step.logprobs, score, passes, f, w))
    if step.teacher_logprobs is not None and want("score"):
        teacher = step.teacher_model_cfg
        f = (flops.score(teacher, b, p, n, t),) * 2
        args = (*step.teacher_weights, *inputs, batch.packing, batch.shared_ids)
        w_teacher = flops.weight_bytes(teacher) / d
        programs.append(_compile("score (teacher)", step.teacher_logprobs, args, 1, f, w_teacher))
        programs[-1].owner = "teacher"
    persistent = {"policy": frozen.per_chip_bytes((step.abstract_state(), step.frozen))}
    if step.teacher_weights is not None:
        persistent["teacher"] = frozen.per_chip_bytes(step.teacher_weights)
    fields = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, layout=cfg.layout)
    for call in frozen.reward_model_calls(learner.cfg, learner.mesh, fields, p + t, n):
        persistent[call.owner] = frozen.per_chip_bytes(call.args[0])
        if want("score"):
            args = (call.name, call.jitted, call.args, call.calls, call.flops, call.weight_bytes)
            programs.append(_compile(*args))
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
        programs.append(_compile("update", step.update, args, calls, f, 3 * w))
    if want("eval"):
        programs += _sampler(learner, "eval", n, p, held_out.sampler_settings(learner), d)[0]
    frozen.set_resident(programs, persistent)
    return programs


def compile_step(
    cfg: Any, preset: presets.Preset, prompt_len: int, only: tuple[str, ...] | None = None
) -> tuple[list[Program], dict]:
    """Compiles the programs of one training step of ``cfg`` on ``preset``'s slice.

    Args:
      cfg: the run's ``TrainConfig`` (its mesh resolved for the slice).
      preset: the slice.
      prompt_len: longest prompt in tokens, without the tools' description, which is added
        (``tool_prompt_tokens``); the prompt bucket is their sum's ``bucket_length``.
      only: name prefixes of the programs to compile (``"sample"``, ``"continue"``,
        ``"score"``, ``"update"``, ``"eval"``); None compiles all.

    Returns:
      (programs, facts): facts hold the mesh, model shape and what the learner decided.
    """
    devices = topology_devices(preset)
    platform = devices[0].platform
    shape = {k: getattr(cfg.mesh, k) for k in ("data", "fsdp", "tensor")}
    mesh = sharding.make_mesh(shape, devices)
    model_cfg = model_config(cfg.model, platform)
    others = memory.second_models(cfg, platform)
    sources = memory.second_model_sources(cfg)
    learner = abstract_learner(cfg, mesh, model_cfg, others)
    tool_tokens = tool_prompt_tokens(learner.agent)
    p, t = bucket_length(prompt_len + tool_tokens), cfg.sampling.max_new_tokens
    programs = _step_programs(learner, p, t, only)
    rules = sharding.sampling_rules(mesh, flops.weight_bytes(model_cfg))
    facts = dict(
        topology=preset.name,
        platform=platform,
        devices=len(devices),
        hosts=len({dev.process_index for dev in devices}),
        mesh=dict(mesh.shape),
        model=cfg.model.source,
        params=memory.base_param_count(model_cfg),
        lora_params=memory.lora_param_count(model_cfg),
        tuning="LoRA" if model_cfg.lora else "full",
        prompt_len=p,
        tool_prompt_tokens=tool_tokens,
        max_new_tokens=t,
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
    )
    return programs, facts
