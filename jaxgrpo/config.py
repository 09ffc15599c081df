"""Run configuration: loading config files, validating them, and the frozen dataclasses.

Config files are ml_collections ``ConfigDict`` files (``configs/*.py`` with ``get_config()``)
built on ``configs/base.py``, whose fields are the schema. ``validate`` rejects unknown keys,
wrong types, bad values and impossible combinations before anything compiles, naming the key.
``to_train_config`` turns a validated ConfigDict into a frozen ``TrainConfig``: nothing past the
CLI boundary sees a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class ConfigError(ValueError):
    """A config problem, with the offending key in the message."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how (``source`` aliases: "smollm2", "tiny")."""

    source: str
    dtype: str
    param_dtype: str
    remat: bool
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Task name and prompt options; ``kwargs`` go to ``jaxgrpo.data.get_task``."""

    name: str
    prompt_template: str
    system_prompt: str
    num_eval: int
    kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """``RewardSet`` specs: (name, weight[, kwargs]), weight a float or a curriculum dict."""

    functions: tuple[tuple[Any, ...], ...]
    reward_on_error: str


@dataclasses.dataclass(frozen=True)
class TemperatureSchedule:
    """Temperature from ``SamplingConfig.temperature`` to ``end`` over ``steps`` (0 = run)."""

    kind: str
    end: float
    steps: int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampler knobs; ``repetition_guard`` is (n, k), n = 0 off."""

    max_new_tokens: int
    temperature: float
    temperature_schedule: TemperatureSchedule
    top_p: float
    top_k: int
    min_p: float
    repetition_guard: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO-family objective and batch layout (see configs/base.py for each field)."""

    prompts_per_step: int
    group_size: int
    loss_type: str
    eps_low: float
    eps_high: float
    beta: float
    kl_estimator: str
    kl_in_reward: bool
    adv_scale: str
    ppo_epochs: int
    num_minibatches: int
    grad_accum: int
    mask_truncated: bool
    dynamic_sampling: bool
    dynamic_sampling_max_draws: int
    ref_reset_every: int
    ref_reset_optimizer: bool
    entropy_coef: float
    tis_cap: float

    @property
    def batch_size(self) -> int:
        """Sequences per step, B * G."""
        return self.prompts_per_step * self.group_size

    @property
    def microbatch_size(self) -> int:
        """Sequences per forward/backward pass."""
        return self.batch_size // (self.num_minibatches * self.grad_accum)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup then cosine/constant schedule and global-norm clipping."""

    lr: float
    warmup_steps: int
    schedule: str
    weight_decay: float
    b1: float
    b2: float
    max_grad_norm: float


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (-1 fills) and multi-host settings ("" / 0 / -1 = from env or auto)."""

    data: int
    fsdp: int
    tensor: int
    coordinator_address: str
    num_processes: int
    process_id: int

    def shape(self) -> dict[str, int]:
        """Axis sizes as the dict ``jaxgrpo.sharding.make_mesh`` takes (-1 still unresolved)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    every: int
    samples_every: int
    tensorboard: bool
    wandb: bool
    wandb_project: str
    progress: bool


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run, frozen. ``to_dict()`` is the JSON snapshot stored with checkpoints."""

    run_dir: str
    seed: int
    steps: int
    resume: bool
    model: ModelSpec
    task: TaskConfig
    rewards: RewardsConfig
    sampling: SamplingConfig
    rl: RLConfig
    optim: OptimConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------
# Loading.


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``jaxgrpo/configs`` (without ``.py``)."""
    names = [f[:-3] for f in os.listdir(SHIPPED_DIR) if f.endswith(".py") and f[0] != "_"]
    return sorted(names)


def resolve_config_path(name: str) -> str:
    """Maps a ``--config`` value to a file path.

    A path that exists (relative to the working directory or absolute) is used as is. Otherwise a
    bare name (``gsm8k_hard`` or ``gsm8k_hard.py``, no directory part) resolves to the shipped
    ``jaxgrpo/configs``. A ``:arg`` suffix (ml_collections' parameterised configs) is kept.

    Raises:
      ConfigError: the file exists nowhere; the message lists the shipped configs.
    """
    path, sep, arg = name.partition(":")
    if os.path.isfile(path):
        return name
    if os.sep not in path and "/" not in path:
        candidate = os.path.join(SHIPPED_DIR, path if path.endswith(".py") else path + ".py")
        if os.path.isfile(candidate):
            return candidate + sep + arg
    raise ConfigError(
        f"config file {path!r} not found (relative to {os.getcwd()!r} or in jaxgrpo/configs). "
        f"Shipped configs: {', '.join(shipped_configs())}"
    )


def load_config_dict(name: str) -> ConfigDict:
    """Loads ``get_config()`` from a config file path or shipped name (unlocked, unvalidated)."""
    path, _, arg = resolve_config_path(name).partition(":")
    spec = importlib.util.spec_from_file_location(f"jaxgrpo_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def load_config(name: str, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Python API twin of the CLI: file (or shipped name) + dotted overrides -> ``TrainConfig``.

    Args:
      name: a config path or shipped name, as for ``--config``.
      overrides: ``{"rl.beta": 0.0, ...}``, as ``--config.rl.beta=0.0`` would set.
    """
    cfg = load_config_dict(name)
    cfg.lock()
    for key, value in (overrides or {}).items():
        node, _, leaf = key.rpartition(".")
        parent = cfg
        for part in filter(None, node.split(".")):
            if part not in parent:
                _unknown_key(key, parent, part)
            parent = parent[part]
        if leaf not in parent:
            _unknown_key(key, parent, leaf)
        try:
            parent[leaf] = value
        except TypeError as e:
            raise ConfigError(f"config key {key!r}: {e}") from None
    return to_train_config(cfg)


def _unknown_key(key: str, parent: ConfigDict, part: str) -> None:
    close = difflib.get_close_matches(part, list(parent.keys()), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown config key {key!r}{hint}")


# ----------------------------------------------------------------------------------------------
# Validation.


def _check_schema(value: Any, default: Any, key: str) -> None:
    """Unknown keys and wrong types, recursively against the base config's defaults."""
    if isinstance(default, ConfigDict):
        if not isinstance(value, ConfigDict | Mapping):
            raise ConfigError(f"config key {key!r} must be a section, got {value!r}")
        if key.endswith("kwargs"):  # free-form keyword arguments for the task
            return
        for sub in value.keys():
            if sub not in default:
                _unknown_key(f"{key}.{sub}".lstrip("."), default, sub)
            _check_schema(value[sub], default[sub], f"{key}.{sub}".lstrip("."))
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


def _require(ok: bool, key: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r}: {message}")


def _one_of(cfg: ConfigDict, key: str, options: tuple) -> None:
    section, _, leaf = key.partition(".")
    value = cfg[section][leaf]
    _require(value in options, key, f"must be one of {list(options)}", value)


def _check_rewards(cfg: ConfigDict) -> None:
    from jaxgrpo.rewards import REWARDS, Curriculum

    functions = cfg.rewards.functions
    _require(len(functions) > 0, "rewards.functions", "needs at least one reward", functions)
    for i, entry in enumerate(functions):
        key = f"rewards.functions[{i}]"
        _require(
            isinstance(entry, tuple | list) and len(entry) in (2, 3) and isinstance(entry[0], str),
            key,
            "must be (name, weight), (name, curriculum dict) or (name, weight, kwargs dict)",
            entry,
        )
        name = entry[0]
        known = name in REWARDS or "." in name or ":" in name
        _require(known, key, f"unknown reward; known: {sorted(REWARDS)} or a dotted path", name)
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
    _one_of(cfg, "rewards.reward_on_error", ("none", "raise"))


def _check_sampling(cfg: ConfigDict) -> None:
    s = cfg.sampling
    _require(s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1", s.max_new_tokens)
    _require(s.temperature >= 0, "sampling.temperature", "must be >= 0", s.temperature)
    sched = s.temperature_schedule
    kinds = ("constant", "linear", "cosine", "exponential")
    key = "sampling.temperature_schedule.kind"
    _require(sched.kind in kinds, key, f"must be one of {list(kinds)}", sched.kind)
    _require(sched.end >= 0, "sampling.temperature_schedule.end", "must be >= 0", sched.end)
    if sched.kind == "exponential":
        ok = s.temperature > 0 and sched.end > 0
        _require(ok, "sampling.temperature_schedule.end", "exponential needs > 0 ends", sched.end)
    _require(sched.steps >= 0, "sampling.temperature_schedule.steps", "must be >= 0", sched.steps)
    _require(0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]", s.top_p)
    _require(s.top_k >= 0, "sampling.top_k", "must be >= 0", s.top_k)
    _require(0 <= s.min_p < 1, "sampling.min_p", "must be in [0, 1)", s.min_p)
    guard = tuple(s.repetition_guard)
    ok = len(guard) == 2 and all(isinstance(g, int) and g >= 0 for g in guard)
    ok = ok and (guard[0] == 0 or guard[1] >= 2)
    _require(ok, "sampling.repetition_guard", "(n, k) ints, n = 0 off, else k >= 2", guard)


def _check_rl(cfg: ConfigDict) -> None:
    r = cfg.rl
    for key in ("prompts_per_step", "ppo_epochs", "num_minibatches", "grad_accum"):
        _require(r[key] >= 1, f"rl.{key}", "must be >= 1", r[key])
    msg = "must be >= 2 (advantages compare samples within a group)"
    _require(r.group_size >= 2, "rl.group_size", msg, r.group_size)
    _one_of(cfg, "rl.loss_type", ("grpo", "dapo", "dr_grpo", "gr_reinforce"))
    _one_of(cfg, "rl.kl_estimator", ("k1", "k2", "k3"))
    _one_of(cfg, "rl.adv_scale", ("group", "batch", "none"))
    _require(0 <= r.eps_low < 1, "rl.eps_low", "must be in [0, 1)", r.eps_low)
    _require(r.eps_high >= 0, "rl.eps_high", "must be >= 0", r.eps_high)
    for key in ("beta", "entropy_coef", "tis_cap", "ref_reset_every"):
        _require(r[key] >= 0, f"rl.{key}", "must be >= 0", r[key])
    draws = r.dynamic_sampling_max_draws
    _require(draws >= 1, "rl.dynamic_sampling_max_draws", "must be >= 1", draws)
    if r.kl_in_reward:
        _require(r.beta > 0, "rl.kl_in_reward", "needs rl.beta > 0", True)
    if r.ref_reset_optimizer:
        msg = "needs rl.ref_reset_every > 0"
        _require(r.ref_reset_every > 0, "rl.ref_reset_optimizer", msg, True)
    batch = r.prompts_per_step * r.group_size
    split = r.num_minibatches * r.grad_accum
    key = "rl.grad_accum" if r.grad_accum > 1 else "rl.num_minibatches"
    _require(
        batch % split == 0,
        key,
        f"num_minibatches * grad_accum = {split} must divide the batch "
        f"prompts_per_step * group_size = {batch}",
        r[key[3:]],
    )


def _check_mesh(cfg: Any, num_devices: int | None) -> dict[str, int]:
    """Mesh checks for a ConfigDict or a TrainConfig; returns the (resolved) axis sizes."""
    m, r = cfg.mesh, cfg.rl
    sizes = {k: getattr(m, k) for k in ("data", "fsdp", "tensor")}
    for k, v in sizes.items():
        _require(v == -1 or v >= 1, f"mesh.{k}", "must be >= 1 or -1 (fill)", v)
    fills = [k for k, v in sizes.items() if v == -1]
    _require(len(fills) <= 1, f"mesh.{fills[-1] if fills else 'data'}", "at most one -1", -1)
    known = math.prod(v for v in sizes.values() if v != -1)
    if num_devices is not None:
        ok = num_devices % known == 0 if fills else known == num_devices
        _require(ok, "mesh", f"axis sizes do not fit {num_devices} devices", sizes)
        if fills:
            sizes[fills[0]] = num_devices // known
    if -1 not in (sizes["data"], sizes["fsdp"]):
        shards = sizes["data"] * sizes["fsdp"]
        micro = r.prompts_per_step * r.group_size // (r.num_minibatches * r.grad_accum)
        _require(
            micro % shards == 0,
            "rl.prompts_per_step",
            f"a micro-batch of (prompts_per_step * group_size) / (num_minibatches * grad_accum)"
            f" = {micro} sequences must be divisible by mesh data * fsdp = {shards}",
            r.prompts_per_step,
        )
    msg = "must be >= -1 (0 = from env, -1 = JAX discovers)"
    _require(m.num_processes >= -1, "mesh.num_processes", msg, m.num_processes)
    return sizes


def resolve_mesh_shape(cfg: TrainConfig, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes for ``num_devices`` devices (-1 filled), checked against the batch.

    Raises:
      ConfigError: the axes do not fit the devices, or a micro-batch does not split evenly over
        data * fsdp.
    """
    return _check_mesh(cfg, num_devices)


def validate(cfg: ConfigDict, num_devices: int | None = None) -> None:
    """Checks keys, types, values and combinations; raises ``ConfigError`` naming the key.

    Args:
      cfg: a config built on ``configs/base.py``.
      num_devices: global device count, to check the mesh fits; None skips device-dependent
        checks (a -1 axis is then left unresolved).
    """
    from jaxgrpo.configs import base

    _check_schema(cfg, base.get_config(), "")
    _require(cfg.steps >= 0, "steps", "must be >= 0", cfg.steps)
    _require(bool(cfg.run_dir), "run_dir", "must not be empty", cfg.run_dir)
    _one_of(cfg, "model.dtype", ("float32", "bfloat16"))
    _one_of(cfg, "model.param_dtype", ("float32", "bfloat16"))
    _require(cfg.model.lora_rank >= 0, "model.lora_rank", "must be >= 0", cfg.model.lora_rank)
    _require(cfg.model.lora_alpha > 0, "model.lora_alpha", "must be > 0", cfg.model.lora_alpha)
    bad = [t for t in cfg.model.lora_targets if t not in LORA_TARGETS]
    _require(not bad, "model.lora_targets", f"unknown {bad}; choose from {LORA_TARGETS}", bad)
    _require(cfg.task.num_eval >= 0, "task.num_eval", "must be >= 0", cfg.task.num_eval)
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
    _require(o.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0", o.max_grad_norm)
    _check_mesh(cfg, num_devices)
    _require(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0", cfg.checkpoint.every)
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", cfg.checkpoint.keep)
    _require(cfg.logging.every >= 1, "logging.every", "must be >= 1", cfg.logging.every)
    samples = cfg.logging.samples_every
    _require(samples >= 0, "logging.samples_every", "must be >= 0", samples)


def to_train_config(cfg: ConfigDict, num_devices: int | None = None) -> TrainConfig:
    """Validates ``cfg`` and converts it to a frozen ``TrainConfig``."""
    validate(cfg, num_devices)
    d = cfg.to_dict()
    m, s, rw = d["model"], d["sampling"], d["rewards"]
    functions = tuple(
        (entry[0], dict(entry[1]) if isinstance(entry[1], Mapping) else float(entry[1]))
        + tuple(dict(x) for x in entry[2:])
        for entry in rw["functions"]
    )
    return TrainConfig(
        run_dir=d["run_dir"],
        seed=d["seed"],
        steps=d["steps"],
        resume=d["resume"],
        model=ModelSpec(**m | _tuple(m, "lora_targets")),
        task=TaskConfig(**{**d["task"], "kwargs": dict(d["task"]["kwargs"])}),
        rewards=RewardsConfig(functions=functions, reward_on_error=rw["reward_on_error"]),
        sampling=SamplingConfig(
            **{**s, "temperature_schedule": TemperatureSchedule(**s["temperature_schedule"])}
            | _tuple(s, "repetition_guard")
        ),
        rl=RLConfig(**d["rl"]),
        optim=OptimConfig(**d["optim"]),
        mesh=MeshConfig(**d["mesh"]),
        checkpoint=CheckpointConfig(**d["checkpoint"]),
        logging=LoggingConfig(**d["logging"]),
    )


def _tuple(section: dict, key: str) -> dict:
    return {key: tuple(section[key])}
