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
from jaxgrpo.core import presets, sharding
from jaxgrpo.core.host import FORCE_HOST_DEVICES_FLAG
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.planning import flops, memory
from jaxgrpo.rl import held_out
from jaxgrpo.rl.learner import Learner
from jaxgrpo.rl.programs import abstract_array
from jaxgrpo.sampling import sampler_programs
from jaxgrpo.settings.model import model_config

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
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


def abstract_learner(cfg: Any, mesh, model_cfg: ModelConfig) -> Learner:
    """A ``Learner`` over an abstract, sharded model: its programs lower, nothing runs."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    model.shard_ctx = sharding.ShardingCtx(mesh, sharding.TRAIN_RULES)
    return Learner(cfg, model, tiny_tokenizer(), SimpleNamespace(name="abstract"), None, mesh)


def _abstract_like(x, sharding_):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_)


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


def _compile(name, jitted, args, calls, flops, weight_bytes, loop_trips=1) -> Program:
    """Lowers and compiles ``jitted`` on ``args``; ``flops`` is (hardware, model) FLOPs."""
    start = time.perf_counter()
    lowered = jitted.lower(*args)
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


def tool_prompt_tokens(agent: Any) -> int:
    """Tokens the tools' description adds to a prompt at ``TOOL_CHARS_PER_TOKEN`` (0: none)."""
    if not agent.enabled:
        return 0
    tools = Agent.from_names(agent.tools, agent.environment, tiny_tokenizer(), format=agent.format)
    return math.ceil(len(tools.instructions) / TOOL_CHARS_PER_TOKEN)


def _sampler(learner, name, prompts, prompt_len, settings, devices, calls=1) -> list[Program]:
    """Compiles one ``generate_from_state`` call's prefill and decode, run ``calls`` times."""
    step, mesh = learner.programs, learner.mesh
    cfg = step.model_cfg
    ids = abstract_array(
        np.zeros((prompts, prompt_len), np.int32), sharding.batch_sharding(mesh, prompts, 2)
    )
    prefill, decode, knobs = sampler_programs(step.graphdef, cfg, ids, settings)
    knobs = _knobs(knobs, step.replicated)
    states = (step.params0, step.frozen)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=step.replicated)
    n, t = prompts * settings.num_samples, settings.max_new_tokens
    f = flops.prefill(cfg, prompts, prompt_len), flops.decode(cfg, n, prompt_len, t)
    f = (f[0], f[0]), (f[1], f[1])
    w = flops.weight_bytes(cfg) / devices
    first = _compile(f"{name}/prefill", prefill, (states, ids, ids, knobs, rng), calls, f[0], w)
    state = jax.eval_shape(prefill, states, ids, ids, knobs, rng)
    if first.compiled is not None:
        state = jax.tree.map(_abstract_like, state, first.compiled.output_shardings)
    else:  # prefill did not fit: rows over data x fsdp, as the compiler would place them
        rows = lambda x: (
            sharding.batch_sharding(mesh, x.shape[0], x.ndim) if x.ndim else step.replicated
        )  # noqa: E731
        state = jax.tree.map(lambda x: _abstract_like(x, rows(x)), state)
    decode_w = flops.weight_bytes(cfg) / mesh.shape["tensor"] * t  # read once per token
    second = _compile(f"{name}/decode", decode, (states, state, knobs), calls, f[1], decode_w, t)
    return [first, second]


def _continuation(learner: Learner, p: int, t: int, devices: int) -> list[Program]:
    """Compiles the sampler of an episode's later turns (``jaxgrpo.agents.rollout``) at its
    largest: every row calls a tool (padded as there and in ``Learner.turn_sampler``), each from
    the prompt bucket and up to T - 1 episode ids, one sample with its own budget per row."""
    rl, mesh = learner.rl, learner.mesh
    rows = bucket_length(rl.prompts_per_step * rl.group_size, 1)
    rows += -rows % (mesh.shape["data"] * mesh.shape["fsdp"])
    budgets = np.full(rows, t, np.int32)
    settings = dataclasses.replace(learner.sampler_settings(0), num_samples=1, max_lengths=budgets)
    turns, width = learner.cfg.agent.max_turns - 1, bucket_length(p + t - 1)
    return _sampler(learner, "continue", rows, width, settings, devices, turns)


def _step_programs(learner: Learner, p: int, t: int, wanted) -> list[Program]:
    """Compiles the step's programs whose names start with one of ``wanted`` (None: all)."""
    step, rl = learner.programs, learner.rl
    cfg = step.model_cfg
    b, n, d = rl.prompts_per_step, rl.prompts_per_step * rl.group_size, learner.mesh.size
    want = lambda name: wanted is None or name.startswith(tuple(wanted))  # noqa: E731
    programs = []
    if want("sample"):
        programs += _sampler(learner, "sample", b, p, learner.sampler_settings(0), d)
    if learner.cfg.agent.enabled and learner.cfg.agent.max_turns > 1 and want("continue"):
        programs += _continuation(learner, p, t, d)  # an episode's later turns
    batch = step.abstract_batch(p, t)
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask, batch.temps)
    score = (step.params0, step.frozen, *inputs, batch.packing, batch.shared_ids)
    passes = int(step.needs_ref) + int(step.old_from == "forward")
    w = flops.weight_bytes(cfg) / d
    if passes and want("score"):
        f = (flops.score(cfg, b, p, n, t),) * 2
        programs.append(_compile("score (ref/old)", step.logprobs, score, passes, f, w))
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
        programs += _sampler(learner, "eval", n, p, held_out.sampler_settings(learner), d)
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
    learner = abstract_learner(cfg, mesh, model_cfg)
    tool_tokens = tool_prompt_tokens(cfg.agent)
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
    )
    return programs, facts


# ----------------------------------------------------------------------------------------------
# The compiled HLO: collectives per computation, while loops and their trip counts.

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE = re.compile(r"body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_COND = re.compile(r"condition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"= s32\[\]\S* constant\((\d+)\)")


def _counted_trips(comps: dict, while_line: str) -> int | None:
    """A loop's trip count: XLA's ``known_trip_count``, else the bound of a condition that is
    one ``counter < constant`` (a ``lax.scan``, whose count XLA:TPU does not annotate)."""
    trips = _TRIPS.search(while_line)
    if trips:
        return int(trips.group(1))
    cond = _COND.search(while_line)
    lines = [line for _, _, line in comps.get(cond.group(1), [])] if cond else []
    bounds = [int(m.group(1)) for m in map(_CONSTANT.search, lines) if m]
    compares = [line for line in lines if " compare(" in line]
    if len(bounds) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
        return bounds[0]
    return None


def _bytes_of(type_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        count = 1
        for x in filter(None, dims.split(",")):
            count *= int(x)
        total += count * _DTYPE_BYTES.get(dtype, 4)
    return total


def _parse(hlo: str) -> tuple[dict, str]:
    """{computation: [(op, bytes, line)]} and the entry computation's name."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        i = _INSTR.match(line)
        if current is not None and i:
            comps[current].append((i.group(2), _bytes_of(i.group(1)), line))
    return comps, entry


def _kind(op: str) -> str | None:
    base = op.removesuffix("-start")
    return base if base in COLLECTIVES else None


def collectives(hlo: str, unknown_trips: int = 1) -> dict[str, Any]:
    """Collectives of a compiled program: whole program (weighted by loop trip counts) and the
    first top-level while loop's body (once, i.e. one decode step for the sampler's loop, with
    the loops inside it, such as the scan over layers, weighted by their trip counts).

    Returns:
      ``{"program": {kind: {count, bytes}}, "loop_body": {...}, "loops": n}``; ``count`` and
      ``bytes`` in ``program`` are per execution (loop bodies times their trips; the top-level
      loops whose count XLA does not know share ``unknown_trips`` evenly, a nested one runs
      once per enclosing iteration).
    """
    comps, entry = _parse(hlo)
    total: dict[str, dict] = {}
    body_first: dict[str, dict] = {}
    loops = 0

    def add(into, kind, size, times):
        slot = into.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += times
        slot["bytes"] += size * times

    def walk(name, times, into_body, body_times, seen):
        """``times``: executions per program run; ``body_times``: per decode step."""
        nonlocal loops
        if name in seen or name not in comps:
            return
        seen = seen | {name}
        for op, size, line in comps[name]:
            kind = _kind(op)
            if kind:
                add(total, kind, size, times)
                if into_body is not None:
                    add(into_body, kind, size, body_times)
            if op == "while":
                body = _WHILE.search(line).group(1)
                trips = _counted_trips(comps, line)
                # Only a top-level loop is the sampler's decode loop; a nested loop that
                # cannot be counted (a sort, a search) counts once per enclosing iteration.
                n = trips if trips is not None else unknown_trips if name == entry else 1
                first, first_times = into_body, body_times * n
                if into_body is None and loops == 0 and name == entry:
                    first, first_times = body_first, 1  # one decode step: its layer scan x L
                if name == entry:
                    loops += 1
                walk(body, times * n, first, first_times, seen)
                continue
            for group in _CALLS.findall(line):
                for callee in group.replace("%", "").split(","):
                    walk(callee.strip(), times, into_body, body_times, seen)

    # The compaction levels' loops share the decode's T steps between them.
    top = [line for op, _, line in comps.get(entry, []) if op == "while"]
    uncounted = sum(_counted_trips(comps, x) is None for x in top)
    unknown_trips = max(1, unknown_trips // max(1, uncounted))
    walk(entry, 1, None, 1, frozenset())
    return {"program": total, "loop_body": body_first, "loops": loops}
