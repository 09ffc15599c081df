"""The sampler's programs, ahead of time: a ``generate_from_state`` call's prefill and decode,
and an episode's later turns (resume, then decode), lowered on the weights the sampler holds.

Where rollouts are sampled decides those weights (``SamplerCopy``): on the learner's own mesh
the sampler runs the learner's graph on the learner's weights; with ``mesh.sampler_devices``
= N it runs on the slice's last N devices, a mesh of its own, with a copy of the weights
placed there by the same rules (``jaxgrpo.rl.sampler_side`` at run time: the frozen weights
once, the trainable ones moved there after every update).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.core import sharding
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.planning import flops
from jaxgrpo.planning.program import Program, compile_program
from jaxgrpo.rl.programs import abstract_array
from jaxgrpo.rl.sampler_side import resplit_on
from jaxgrpo.sampling import sampler_programs
from jaxgrpo.sampling.generate import APPEND, earlier_width
from jaxgrpo.sampling.resume import pack_program, resume_programs


@dataclasses.dataclass(frozen=True)
class SamplerCopy:
    """The abstract weights and graph the sampler's programs run on.

    Attributes:
      mesh: where the sampler runs.
      graphdef: the policy's graph, its sharding context on ``mesh``.
      model_cfg: the policy's ``ModelConfig``.
      params: the trainable params (one version), sharded on ``mesh``.
      frozen: the frozen weights, sharded on ``mesh``.
    """

    mesh: Any
    graphdef: Any
    model_cfg: Any
    params: Any
    frozen: Any

    @property
    def replicated(self):
        """A whole array on every device of ``mesh``."""
        return sharding.replicated(self.mesh)

    @classmethod
    def shared(cls, programs) -> SamplerCopy:
        """The learner's devices: its graph and weights (``StepPrograms``)."""
        p = programs
        return cls(p.mesh, p.graphdef, p.model_cfg, p.params0, p.frozen)

    @classmethod
    def own(cls, programs, mesh) -> SamplerCopy:
        """Devices of the sampler's own (``mesh``): the learner's graph re-split with its
        sharding context on ``mesh``, trainable and frozen parts placed there by the learner's
        rules, as ``jaxgrpo.rl.sampler_side.SamplerSide.own`` places real ones."""
        p = programs
        graphdef, trainable, frozen, rules = resplit_on(p, mesh, p.params0, p.frozen)
        place = lambda tree: jax.tree.map(  # noqa: E731
            abstract_array, tree, sharding.param_shardings(tree, mesh, rules)
        )
        return cls(mesh, graphdef, p.model_cfg, place(trainable), place(frozen))


def _knobs(knobs, replicated):
    return jax.tree.map(lambda x: abstract_array(x, replicated), knobs)


def _rng(copy: SamplerCopy):
    """The abstract PRNG key of a sampler call, replicated."""
    return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=copy.replicated)


def generate_programs(
    copy: SamplerCopy, name: str, prompts: int, prompt_len: int, settings, calls: int = 1
) -> tuple[list[Program], Any]:
    """Compiles one ``generate_from_state`` call's prefill and decode on ``copy``, run
    ``calls`` times; and the decode's abstract output (None if it did not fit)."""
    mesh, cfg = copy.mesh, copy.model_cfg
    ids = abstract_array(
        np.zeros((prompts, prompt_len), np.int32), sharding.batch_sharding(mesh, prompts, 2)
    )
    prefill, decode, knobs = sampler_programs(copy.graphdef, cfg, ids, settings)
    knobs = _knobs(knobs, copy.replicated)
    states = (copy.params, copy.frozen)
    n, t = prompts * settings.num_samples, settings.max_new_tokens
    f = flops.prefill(cfg, prompts, prompt_len), flops.decode(cfg, n, prompt_len, t)
    f = (f[0], f[0]), (f[1], f[1])
    w = flops.weight_bytes(cfg) / mesh.size
    args = (states, ids, ids, knobs, _rng(copy))
    first = compile_program(f"{name}/prefill", prefill, args, calls, f[0], w)
    state = jax.eval_shape(prefill, *args)
    second, out = _decode(copy, name, decode, first, state, knobs, calls, f[1], t)
    return [first, second], out


def _decode(copy, name, decode, first, state, knobs, calls, f, t) -> tuple[Program, Any]:
    """The decode program after ``first`` (a prefill or a later turn's resume, whose abstract
    output is ``state``), and its own abstract output."""
    mesh = copy.mesh
    if first.compiled is not None:
        state = jax.tree.map(abstract_array, state, first.compiled.output_shardings)
    else:  # prefill did not fit: rows over data x fsdp, as the compiler would place them
        rows = lambda x: (
            sharding.batch_sharding(mesh, x.shape[0], x.ndim) if x.ndim else copy.replicated
        )  # noqa: E731
        state = jax.tree.map(lambda x: abstract_array(x, rows(x)), state)
    decode_w = flops.weight_bytes(copy.model_cfg) / mesh.shape["tensor"] * t  # once per token
    states = (copy.params, copy.frozen)
    args = (states, state, knobs)
    second = compile_program(f"{name}/decode", decode, args, calls, f, decode_w, t)
    out = None
    if second.compiled is not None:
        out = jax.eval_shape(decode, states, state, knobs)
        out = jax.tree.map(abstract_array, out, second.compiled.output_shardings)
    return second, out


def continuation_programs(
    copy: SamplerCopy, learner, p: int, t: int, first_turn: Any
) -> list[Program]:
    """Compiles the sampler of an episode's later turns (``jaxgrpo.agents.rollout``) at its
    largest: every row calls a tool (padded as there), the first turn's kept cache
    (``first_turn``, the decode's abstract output) laid out for the later turns with up to
    T - 1 earlier ids (``continue/pack``), the passes of its longest result, a
    ``agent.max_tool_tokens`` result and ``APPEND`` ids of the format's text
    (``continue/resume``), then one sample with its own budget, once per later turn.
    ``learner`` gives the run's settings (batch, turns, sampler)."""
    rl, mesh = learner.rl, copy.mesh
    rows = bucket_length(rl.prompts_per_step * rl.group_size, 1)
    rows += -rows % (mesh.shape["data"] * mesh.shape["fsdp"])
    settings = dataclasses.replace(
        learner.sampler_settings(0), max_lengths=np.full(rows, t, np.int32)
    )
    batch = lambda shape: abstract_array(  # noqa: E731
        np.zeros(shape, np.int32), sharding.batch_sharding(mesh, rows, len(shape))
    )
    ids = batch((rows, APPEND))
    resume, decode, knobs = resume_programs(copy.graphdef, copy.model_cfg, ids, settings)
    knobs = _knobs(knobs, copy.replicated)
    states, cache = (copy.params, copy.frozen), first_turn.cache
    per_row = (batch((rows,)),) * 3
    width, slots = earlier_width(t), APPEND + t
    cfg, turns = copy.model_cfg, learner.cfg.agent.max_turns - 1
    passes = -(-min(t, learner.cfg.agent.max_tool_tokens + APPEND) // APPEND)
    pack = pack_program(copy.graphdef, copy.model_cfg)
    sizes = {"width": width, "slots": slots}
    packed_cache = jax.eval_shape(functools.partial(pack, **sizes), states, cache, *per_row)
    # Both move a later turn's whole cache (each pass packs it again): bytes read per call.
    moved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(packed_cache)) / mesh.size
    args = (states, cache, *per_row)
    packed = compile_program("continue/pack", pack, args, 1, (0, 0), moved, kwargs=sizes)
    if packed.compiled is not None:
        shardings = packed.compiled.output_shardings
        packed_cache = jax.tree.map(abstract_array, packed_cache, shardings)
    args = (states, packed_cache, *per_row, ids, ids, knobs, _rng(copy))
    f = (flops.prefill(cfg, rows, APPEND),) * 2
    w = flops.weight_bytes(cfg) / mesh.size + moved
    kwargs = {"width": width}
    first = compile_program("continue/resume", resume, args, turns * passes, f, w, kwargs=kwargs)
    state = jax.eval_shape(functools.partial(resume, **kwargs), *args)
    f = (flops.decode(cfg, rows, p + width + APPEND, t),) * 2
    return [packed, first, _decode(copy, "continue", decode, first, state, knobs, turns, f, t)[0]]
