"""Config validation: unknown keys, wrong types, bad values and impossible combinations.

Every error is a ``ConfigError`` whose message starts with the offending key, raised before
anything is built or compiled. The schema is ``configs/base.py``: its keys are the known keys and
its default values give each key's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import string
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict

from jaxgrpo.agents.formats import FORMATS
from jaxgrpo.agents.tools import TOOLS
from jaxgrpo.configs import base
from jaxgrpo.core import presets
from jaxgrpo.core.errors import ConfigError, config_require
from jaxgrpo.data import TASKS
from jaxgrpo.models.config import LORA_TARGETS, REMAT_POLICIES
from jaxgrpo.rewards import REWARDS, Curriculum
from jaxgrpo.rewards.reward_model import OPTIONS as REWARD_MODEL_OPTIONS
from jaxgrpo.rewards.reward_model import is_model_source
from jaxgrpo.rl.advantages import BASELINES, SCALES
from jaxgrpo.rl.batch_layout import check_batch_layout
from jaxgrpo.rl.kl import KL_ESTIMATORS
from jaxgrpo.rl.loss_spec import LAG_CORRECTIONS, LOSS_PRESETS, STALE_BATCHES
from jaxgrpo.sampling.schedules import SCHEDULES
from jaxgrpo.sampling.stop_strings import check_stop_strings


def unknown_key_error(key: str, parent: Any, part: str) -> ConfigError:
    """The error for ``key`` whose component ``part`` is not in ``parent``, with a suggestion."""
    names = list(parent.keys()) if hasattr(parent, "keys") else []
    close = difflib.get_close_matches(part, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


# ----------------------------------------------------------------------------------------------
# Validation.


# Keys whose values are of more than one type (checked by their section's check).
_ANY_TYPE = ("rewards.conversational",)


def _check_schema(value: Any, default: Any, key: str) -> None:
    """Unknown keys and wrong types, recursively against the base config's defaults."""
    if isinstance(default, ConfigDict):
        if not isinstance(value, ConfigDict | Mapping):
            raise ConfigError(f"config key {key!r} must be a section, got {value!r}")
        if key.endswith("kwargs") or key == "agent.environments":  # free-form: the user's names
            return
        for sub in value.keys():
            if sub not in default:
                raise unknown_key_error(f"{key}.{sub}".lstrip("."), default, sub)
            _check_schema(value[sub], default[sub], f"{key}.{sub}".lstrip("."))
        return
    if key in _ANY_TYPE:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif isinstance(default, tuple | list):
        ok = isinstance(value, tuple | list)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(
            f"config key {key!r} must be {type(default).__name__}, got {value!r} "
            f"({type(value).__name__})"
        )


_require = config_require


def _one_of(cfg: ConfigDict, key: str, options: tuple) -> None:
    section, _, leaf = key.partition(".")
    value = cfg[section][leaf]
    _require(value in options, key, f"must be one of {list(options)}", value)


def _check_rewards(cfg: ConfigDict) -> None:
    functions = cfg.rewards.functions
    ok = len(functions) > 0 or cfg.teacher.distill_coef > 0
    msg = "needs at least one reward (none only with a teacher: teacher.distill_coef > 0)"
    _require(ok, "rewards.functions", msg, functions)
    for i, entry in enumerate(functions):
        key = f"rewards.functions[{i}]"
        _require(
            isinstance(entry, tuple | list) and len(entry) in (2, 3) and isinstance(entry[0], str),
            key,
            "must be (name, weight), (name, curriculum dict) or (name, weight, kwargs dict)",
            entry,
        )
        name = entry[0]
        model = name not in REWARDS and is_model_source(name)
        known = name in REWARDS or "." in name or ":" in name or model
        why = f"unknown reward; known: {sorted(REWARDS)}, a dotted path or a reward model path"
        _require(known, key, why, name)
        weight = entry[1]
        if isinstance(weight, bool) or not isinstance(weight, int | float | Mapping):
            _require(False, key, "weight must be a number or a curriculum dict", weight)
        if not isinstance(weight, Mapping):
            _require(math.isfinite(weight), key, "weight must be finite", weight)
        try:
            Curriculum.from_spec(dict(weight) if isinstance(weight, Mapping) else weight)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config key {key!r}: bad curriculum {weight!r}: {e}") from None
        if len(entry) == 3:
            _require(isinstance(entry[2], Mapping), key, "kwargs must be a dict", entry[2])
        if model and len(entry) == 3:
            bad = sorted(set(entry[2]) - set(REWARD_MODEL_OPTIONS))
            _require(not bad, key, f"a reward model takes {list(REWARD_MODEL_OPTIONS)}", bad)
            for option, value in entry[2].items():
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                _require(ok, key, f"{option} must be an int >= 1", value)
    _one_of(cfg, "rewards.reward_on_error", ("none", "raise"))
    chats = cfg.rewards.conversational
    ok = isinstance(chats, bool) or (isinstance(chats, str) and chats == "auto")
    _require(ok, "rewards.conversational", "must be True, False or 'auto'", chats)
    failed = cfg.rewards.max_failed_steps
    _require(failed >= 1, "rewards.max_failed_steps", "must be >= 1", failed)
    for key in ("timeout_s", "max_memory_gb"):
        value = cfg.rewards[key]
        ok = not isinstance(value, bool) and isinstance(value, int | float) and value >= 0
        _require(
            ok and math.isfinite(value), f"rewards.{key}", "must be >= 0 (0 = no limit)", value
        )


def _check_sampling(cfg: ConfigDict) -> None:
    s = cfg.sampling
    _require(s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1", s.max_new_tokens)
    greedy = "must be > 0: greedy samples of a group are identical, so every advantage is 0"
    _require(s.temperature > 0, "sampling.temperature", greedy, s.temperature)
    for name in ("temperature_schedule", "position_schedule"):
        _check_schedule(s[name], f"sampling.{name}", greedy)
    _require(0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]", s.top_p)
    _require(s.top_k >= 0, "sampling.top_k", "must be >= 0", s.top_k)
    _require(0 <= s.min_p < 1, "sampling.min_p", "must be in [0, 1)", s.min_p)
    guard = tuple(s.repetition_guard)
    ok = len(guard) == 2 and all(isinstance(g, int) and g >= 0 for g in guard)
    ok = ok and (guard[0] == 0 or guard[1] >= 2)
    _require(ok, "sampling.repetition_guard", "(n, k) ints, n = 0 off, else k >= 2", guard)
    stop = s.stop
    _require(isinstance(stop, tuple | list), "sampling.stop", "must be a tuple of strings", stop)
    try:
        check_stop_strings(stop, "'sampling.stop'")
    except ValueError as e:
        raise ConfigError(f"config key {e}") from None


def _check_task(task: ConfigDict) -> None:
    """A known task, and keyword arguments that are fields of its dataclass."""
    _require(task.name in TASKS, "task.name", f"unknown task; known: {sorted(TASKS)}", task.name)
    fields = {f.name for f in dataclasses.fields(TASKS[task.name]) if f.init}
    for name in task.kwargs.keys():
        options = ", ".join(sorted(fields))
        msg = f"task {task.name!r} has no option {name!r}; its options: {options}"
        _require(name in fields, f"task.kwargs.{name}", msg, task.kwargs[name])


def _check_schedule(sched: ConfigDict, key: str, greedy: str) -> None:
    """A ``configs/base._schedule`` section: a known kind with positive values."""
    kinds = list(SCHEDULES)
    _require(sched.kind in kinds, f"{key}.kind", f"must be one of {kinds}", sched.kind)
    _require(sched.steps >= 0, f"{key}.steps", "must be >= 0", sched.steps)
    if sched.kind == "piecewise":
        levels, bounds = list(sched.levels), list(sched.boundaries)
        msg = "needs len(levels) == len(boundaries) + 1"
        _require(len(levels) == len(bounds) + 1, f"{key}.levels", msg, tuple(levels))
        _require(all(v > 0 for v in levels), f"{key}.levels", greedy, tuple(levels))
        ok = bounds == sorted(set(bounds)) and all(isinstance(b, int) for b in bounds)
        _require(ok, f"{key}.boundaries", "must be increasing integers", tuple(bounds))
    elif sched.kind != "constant":
        _require(sched.end > 0, f"{key}.end", greedy, sched.end)


def _check_rl(cfg: ConfigDict) -> None:
    r = cfg.rl
    for key in ("prompts_per_step", "ppo_epochs", "num_minibatches", "grad_accum"):
        _require(r[key] >= 1, f"rl.{key}", "must be >= 1", r[key])
    msg = "must be >= 2 (advantages compare samples within a group)"
    _require(r.group_size >= 2, "rl.group_size", msg, r.group_size)
    _one_of(cfg, "rl.loss_type", tuple(LOSS_PRESETS))
    _one_of(cfg, "rl.kl_estimator", KL_ESTIMATORS)
    _one_of(cfg, "rl.adv_scale", ("auto", *SCALES))
    _one_of(cfg, "rl.baseline", BASELINES)
    _require(0 <= r.eps_low < 1, "rl.eps_low", "must be in [0, 1)", r.eps_low)
    _require(r.eps_high >= 0, "rl.eps_high", "must be >= 0", r.eps_high)
    cap = "must be 0 (off) or > 1 + rl.eps_high (a cap inside the clip range clips twice)"
    _require(r.ratio_cap == 0 or r.ratio_cap > 1 + r.eps_high, "rl.ratio_cap", cap, r.ratio_cap)
    _require(r.dual_clip == 0 or r.dual_clip > 1, "rl.dual_clip", "must be 0 or > 1", r.dual_clip)
    frac = r.top_entropy_frac
    _require(0 <= frac <= 1, "rl.top_entropy_frac", "must be in [0, 1] (0 = every token)", frac)
    tis = "must be 0 (off) or >= 1 (a cap below 1 would shrink every on-policy token)"
    _require(r.tis_cap == 0 or r.tis_cap >= 1, "rl.tis_cap", tis, r.tis_cap)
    for key in ("beta", "entropy_coef", "ref_reset_every"):
        _require(r[key] >= 0, f"rl.{key}", "must be >= 0", r[key])
    cols = r.micro_batch_columns
    _require(cols >= -1, "rl.micro_batch_columns", "must be -1 (auto), 0 (off) or > 0", cols)
    draws = r.dynamic_sampling_max_draws
    _require(draws >= 1, "rl.dynamic_sampling_max_draws", "must be >= 1", draws)
    if r.kl_in_reward:
        _require(r.beta > 0, "rl.kl_in_reward", "needs rl.beta > 0", True)
    if r.ref_reset_optimizer:
        msg = "needs rl.ref_reset_every > 0"
        _require(r.ref_reset_every > 0, "rl.ref_reset_optimizer", msg, True)
    check_batch_layout(r, None)
    _check_lag(cfg)


def _check_lag(cfg: ConfigDict) -> None:
    """Asynchronous rollouts: the lag bound, its correction and what it cannot serve."""
    r, m = cfg.rl, cfg.mesh
    _require(r.max_staleness >= 0, "rl.max_staleness", "must be >= 0", r.max_staleness)
    _one_of(cfg, "rl.stale_batches", STALE_BATCHES)
    _one_of(cfg, "rl.lag_correction", LAG_CORRECTIONS)
    _require(r.lag_cap >= 1, "rl.lag_cap", "must be >= 1", r.lag_cap)
    _require(0 < r.lag_floor <= 1, "rl.lag_floor", "must be in (0, 1]", r.lag_floor)
    _require(m.sampler_devices >= 0, "mesh.sampler_devices", "must be >= 0", m.sampler_devices)
    if r.max_staleness == 0:
        msg = "needs rl.max_staleness >= 1 (a synchronous loop has no stale batches to drop)"
        _require(r.stale_batches == "wait", "rl.stale_batches", msg, r.stale_batches)
        msg = (
            "needs rl.max_staleness >= 1 (a synchronous sampler on devices of its own would "
            "leave the learner's idle while it samples)"
        )
        _require(m.sampler_devices == 0, "mesh.sampler_devices", msg, m.sampler_devices)
        return
    msg = (
        "must be 0 when rl.max_staleness >= 1: rl.lag_correction handles the same "
        "learner/sampler ratio (rl.lag_cap caps its weight)"
    )
    _require(r.tis_cap == 0, "rl.tis_cap", msg, r.tis_cap)
    msg = (
        "must be 1 (one process) when rl.max_staleness >= 1: the sampler's and the learner's "
        "threads would issue collectives in different orders on different hosts"
    )
    _require(m.num_processes in (0, 1), "mesh.num_processes", msg, m.num_processes)


def _check_eval(cfg: ConfigDict) -> None:
    e = cfg.eval
    for key in ("num_samples", "max_new_tokens", "batch_size"):
        _require(e[key] >= 1, f"eval.{key}", "must be >= 1", e[key])
    _require(e.every >= 0, "eval.every", "must be >= 0 (0 = before and after training)", e.every)
    _require(e.temperature >= 0, "eval.temperature", "must be >= 0 (0 = greedy)", e.temperature)
    _require(0 < e.top_p <= 1, "eval.top_p", "must be in (0, 1]", e.top_p)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(e.judge_prompt) if name}
    except ValueError as err:  # e.g. an unmatched "{": literal braces are written "{{" "}}"
        raise ConfigError(f"config key 'eval.judge_prompt': {err}") from None
    allowed = {"question", "reference", "completion"}
    msg = f"placeholders {sorted(fields - allowed)} unknown; use {sorted(allowed)}"
    _require(fields <= allowed, "eval.judge_prompt", msg, e.judge_prompt)
    msg = "needs {completion} (the judge must see the answer it judges)"
    _require("completion" in fields, "eval.judge_prompt", msg, e.judge_prompt)


def _check_agent(cfg: ConfigDict) -> None:
    """Names that can be dotted paths and limits that can hold; the names are imported, and
    each tool's schema built, when the run builds its ``jaxgrpo.agents.Agent``."""
    a = cfg.agent
    for i, name in enumerate(a.tools):
        ok = isinstance(name, str) and (name in TOOLS or "." in name or ":" in name)
        msg = f"must be a built-in tool {sorted(TOOLS)} or a dotted name ('my_pkg.tools.fn')"
        _require(ok, f"agent.tools[{i}]", msg, name)
    env = a.environment
    ok = env == "" or "." in env or ":" in env
    _require(ok, "agent.environment", "must be a dotted name ('my_pkg.envs.Game') or ''", env)
    for name, path in a.environments.items():
        ok = isinstance(path, str) and ("." in path or ":" in path)
        msg = "must be a dotted name ('my_pkg.envs.Game')"
        _require(ok, f"agent.environments.{name}", msg, path)
    both = bool(env and a.environments)
    msg = "set agent.environment (one environment) or agent.environments (several), not both"
    _require(not both, "agent.environments", msg, dict(a.environments))
    _one_of(cfg, "agent.format", ("auto", *FORMATS))
    _require(a.max_turns >= 1, "agent.max_turns", "must be >= 1", a.max_turns)
    _require(a.max_tool_tokens >= 1, "agent.max_tool_tokens", "must be >= 1", a.max_tool_tokens)
    timeout = a.tool_timeout_s
    _require(timeout > 0 and math.isfinite(timeout), "agent.tool_timeout_s", "must be > 0", timeout)
    w = a.environment_reward_weight
    ok = math.isfinite(w) and w >= 0
    _require(ok, "agent.environment_reward_weight", "must be >= 0 (0 = not used)", w)


def _check_teacher(cfg: ConfigDict) -> None:
    """A teacher is set exactly when something uses it; its tokenizer is checked on load."""
    t = cfg.teacher
    c = t.distill_coef
    _require(math.isfinite(c) and c >= 0, "teacher.distill_coef", "must be >= 0 (0 = off)", c)
    used = c > 0 or t.as_reference
    msg = "is set, but neither teacher.distill_coef > 0 nor teacher.as_reference uses it"
    _require(not t.source or used, "teacher.source", msg, t.source)
    msg = "needs teacher.source (the teacher to distil from or to stay close to)"
    _require(bool(t.source) or not used, "teacher.source", msg, t.source)
    msg = "needs rl.beta > 0 (the KL penalty's weight toward the teacher)"
    _require(not t.as_reference or cfg.rl.beta > 0, "teacher.as_reference", msg, t.as_reference)
    if t.source:
        _check_source(t.source, "teacher.source")


def _check_source(source: str, key: str = "model.source") -> None:
    """``random:<name>`` must name a known architecture (other sources are checked on load)."""
    if source.startswith(presets.RANDOM_PREFIX):
        name = source.removeprefix(presets.RANDOM_PREFIX)
        known = ", ".join(presets.ARCHITECTURES)
        ok = name in presets.ARCHITECTURES
        _require(ok, key, f"unknown architecture {name!r}; known: {known}", source)


def check_mesh(cfg: Any, num_devices: int | None) -> dict[str, int]:
    """Mesh checks for a ConfigDict or a TrainConfig; returns the (resolved) axis sizes."""
    m, r = cfg.mesh, cfg.rl
    sizes = {k: getattr(m, k) for k in ("data", "fsdp", "tensor")}
    for k, v in sizes.items():
        _require(v == -1 or v >= 1, f"mesh.{k}", "must be >= 1 or -1 (fill)", v)
    fills = [k for k, v in sizes.items() if v == -1]
    _require(len(fills) <= 1, f"mesh.{fills[-1] if fills else 'data'}", "at most one -1", -1)
    known = math.prod(v for v in sizes.values() if v != -1)
    if num_devices is not None and m.sampler_devices > 0:
        msg = f"leaves the learner no devices of the {num_devices}"
        _require(m.sampler_devices < num_devices, "mesh.sampler_devices", msg, m.sampler_devices)
        num_devices -= m.sampler_devices  # the learner's mesh
    if num_devices is not None:
        ok = num_devices % known == 0 if fills else known == num_devices
        _require(ok, "mesh", f"axis sizes do not fit {num_devices} devices", sizes)
        if fills:
            sizes[fills[0]] = num_devices // known
    if -1 not in (sizes["data"], sizes["fsdp"]):
        check_batch_layout(r, sizes["data"] * sizes["fsdp"])
    msg = "must be >= -1 (0 = from env, -1 = JAX discovers)"
    _require(m.num_processes >= -1, "mesh.num_processes", msg, m.num_processes)
    return sizes


def sampler_mesh_shape(cfg: Any, learner_shape: dict[str, int]) -> dict[str, int]:
    """The sampler's own mesh over ``mesh.sampler_devices`` devices: the learner's tensor
    axis (a device holds the same slice of every layer on both sides), as much of its fsdp
    axis as divides the rest, and data over what is left."""
    n, tensor = cfg.mesh.sampler_devices, learner_shape["tensor"]
    msg = f"must be a multiple of mesh.tensor = {tensor} (the sampler keeps the tensor axis)"
    _require(n % tensor == 0, "mesh.sampler_devices", msg, n)
    fsdp = math.gcd(learner_shape["fsdp"], n // tensor)
    return {"data": n // (tensor * fsdp), "fsdp": fsdp, "tensor": tensor}


def validate(cfg: ConfigDict, num_devices: int | None = None) -> None:
    """Checks keys, types, values and combinations; raises ``ConfigError`` naming the key.

    Args:
      cfg: a config built on ``configs/base.py``.
      num_devices: global device count, to check the mesh fits; None skips device-dependent
        checks (a -1 axis is then left unresolved).
    """
    _check_schema(cfg, base.get_config(), "")
    _require(cfg.steps >= 0, "steps", "must be >= 0", cfg.steps)
    _require(bool(cfg.run_dir), "run_dir", "must not be empty", cfg.run_dir)
    _one_of(cfg, "model.dtype", ("float32", "bfloat16"))
    _one_of(cfg, "model.param_dtype", ("float32", "bfloat16"))
    _check_source(cfg.model.source)
    _one_of(cfg, "model.layer_loop", ("auto", "scan", "unroll"))
    _one_of(cfg, "model.remat_policy", REMAT_POLICIES)
    _require(cfg.model.lora_rank >= 0, "model.lora_rank", "must be >= 0", cfg.model.lora_rank)
    _require(cfg.model.lora_alpha > 0, "model.lora_alpha", "must be > 0", cfg.model.lora_alpha)
    bad = [t for t in cfg.model.lora_targets if t not in LORA_TARGETS]
    _require(not bad, "model.lora_targets", f"unknown {bad}; choose from {LORA_TARGETS}", bad)
    _require(cfg.task.num_eval >= 0, "task.num_eval", "must be >= 0", cfg.task.num_eval)
    _check_task(cfg.task)
    _check_rewards(cfg)
    _check_sampling(cfg)
    _check_rl(cfg)
    o = cfg.optim
    _require(o.lr > 0, "optim.lr", "must be > 0", o.lr)
    _require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", o.warmup_steps)
    _one_of(cfg, "optim.schedule", ("cosine", "constant"))
    _require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    _require(0 <= o.b1 < 1, "optim.b1", "must be in [0, 1)", o.b1)
    _require(0 <= o.b2 < 1, "optim.b2", "must be in [0, 1)", o.b2)
    _require(o.eps > 0, "optim.eps", "must be > 0", o.eps)
    _require(o.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0", o.max_grad_norm)
    check_mesh(cfg, num_devices)
    _require(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0", cfg.checkpoint.every)
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", cfg.checkpoint.keep)
    _require(cfg.logging.every >= 1, "logging.every", "must be >= 1", cfg.logging.every)
    samples = cfg.logging.samples_every
    _require(samples >= 0, "logging.samples_every", "must be >= 0", samples)
    _check_eval(cfg)
    _check_agent(cfg)
    _check_teacher(cfg)
