"""Run configuration as frozen dataclasses, and their construction from a validated ConfigDict.

Config files are ml_collections ``ConfigDict`` files (``configs/*.py`` with ``get_config()``)
built on ``configs/base.py``, whose fields are the schema; ``jaxgrpo.settings.loading`` reads
them and applies overrides. ``validate`` rejects unknown keys, wrong types, bad values and
impossible combinations before anything compiles, naming the key. ``to_train_config`` turns a
validated ConfigDict into a frozen ``TrainConfig``: nothing past the CLI boundary sees a
ConfigDict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict

from jaxgrpo.rl.loss_spec import LOSS_PRESETS
from jaxgrpo.settings.checks import check_mesh, validate


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how (``source`` aliases: "smollm2", "tiny")."""

    source: str
    dtype: str
    param_dtype: str
    remat: bool
    remat_policy: str
    layer_loop: str
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
    """``RewardSet`` specs: (name, weight[, kwargs]), weight a float or a curriculum dict;
    ``conversational``: True, False or ``"auto"`` (``RewardSet``'s)."""

    functions: tuple[tuple[Any, ...], ...]
    reward_on_error: str
    max_failed_steps: int
    conversational: bool | str
    timeout_s: float
    max_memory_gb: float


@dataclasses.dataclass(frozen=True)
class TemperatureSchedule:
    """A schedule (``jaxgrpo.sampling.schedules.build``): from its initial value to ``end`` over
    ``steps`` (0 = the whole run or completion), or ``levels`` between ``boundaries``."""

    kind: str
    end: float
    steps: int
    boundaries: tuple[int, ...]
    levels: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampler knobs; ``repetition_guard`` is (n, k), n = 0 off."""

    max_new_tokens: int
    temperature: float
    temperature_schedule: TemperatureSchedule
    position_schedule: TemperatureSchedule
    top_p: float
    top_k: int
    min_p: float
    repetition_guard: tuple[int, int]
    stop: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO-family objective and batch layout (see configs/base.py for each field)."""

    prompts_per_step: int
    group_size: int
    loss_type: str
    eps_low: float
    eps_high: float
    ratio_cap: float
    dual_clip: float
    top_entropy_frac: float
    beta: float
    kl_estimator: str
    kl_in_reward: bool
    kl_bias_correction: bool
    adv_scale: str
    baseline: str
    ppo_epochs: int
    num_minibatches: int
    grad_accum: int
    micro_batch_columns: int
    mask_truncated: bool
    pack_completions: bool
    share_prompt_prefix: bool
    dynamic_sampling: bool
    dynamic_sampling_max_draws: int
    ref_reset_every: int
    ref_reset_optimizer: bool
    entropy_coef: float
    tis_cap: float
    max_staleness: int
    stale_batches: str
    lag_correction: str
    lag_cap: float
    lag_floor: float

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
    eps: float
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
    sampler_devices: int

    def shape(self) -> dict[str, int]:
        """Axis sizes as the dict ``jaxgrpo.core.sharding.make_mesh`` takes (-1 unresolved)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Save period in steps (0 = only at exit) and how many checkpoints to keep."""

    every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metric and sample periods and which sinks are on (see configs/base.py)."""

    every: int
    samples_every: int
    tensorboard: bool
    wandb: bool
    wandb_project: str
    progress: bool


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: the period during training (greedy, ``every`` steps; 0 = before and
    after only), and ``python -m jaxgrpo.evaluate``'s defaults (the seed study's) and judge,
    which its CLI flags override."""

    every: int
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int
    judge_source: str
    judge_prompt: str


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Tools and environments (see configs/base.py): episodes of several turns when ``tools``
    or ``environment`` is set."""

    tools: tuple[str, ...]
    environment: str
    environments: dict[str, str]
    environment_reward_weight: float
    max_turns: int
    max_tool_tokens: int
    tool_timeout_s: float
    format: str

    @property
    def enabled(self) -> bool:
        """Whether rollouts are episodes with tools (else single completions)."""
        return bool(self.tools or self.environment or self.environments)


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """A frozen second model scoring the policy's tokens (see configs/base.py): the
    distillation term's coefficient, and whether the KL penalty targets it."""

    source: str = ""
    distill_coef: float = 0.0
    as_reference: bool = False

    @property
    def enabled(self) -> bool:
        """Whether a run loads the teacher and scores its rollouts with it."""
        return bool(self.source) and (self.distill_coef > 0 or self.as_reference)


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
    eval: EvalConfig
    agent: AgentConfig
    teacher: TeacherConfig = TeacherConfig()

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def resolve_mesh_shape(cfg: TrainConfig, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes for ``num_devices`` devices (-1 filled), checked against the batch.

    Raises:
      ConfigError: the axes do not fit the devices, or a micro-batch does not split evenly over
        data * fsdp.
    """
    return check_mesh(cfg, num_devices)


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
        rewards=RewardsConfig(
            functions=functions,
            reward_on_error=rw["reward_on_error"],
            max_failed_steps=rw["max_failed_steps"],
            conversational=rw["conversational"],
            timeout_s=float(rw["timeout_s"]),
            max_memory_gb=float(rw["max_memory_gb"]),
        ),
        sampling=SamplingConfig(
            **s
            | {k: _schedule(s[k]) for k in ("temperature_schedule", "position_schedule")}
            | _tuple(s, "repetition_guard")
            | _tuple(s, "stop")
        ),
        rl=RLConfig(**d["rl"] | {"adv_scale": resolve_adv_scale(d["rl"])}),
        optim=OptimConfig(**d["optim"]),
        mesh=MeshConfig(**d["mesh"]),
        checkpoint=CheckpointConfig(**d["checkpoint"]),
        logging=LoggingConfig(**d["logging"]),
        eval=EvalConfig(**d["eval"]),
        agent=AgentConfig(
            **d["agent"]
            | _tuple(d["agent"], "tools")
            | {"environments": dict(d["agent"]["environments"])}
            | {"tool_timeout_s": float(d["agent"]["tool_timeout_s"])}
            | {"environment_reward_weight": float(d["agent"]["environment_reward_weight"])}
        ),
        teacher=TeacherConfig(
            **d["teacher"] | {"distill_coef": float(d["teacher"]["distill_coef"])}
        ),
    )


def resolve_adv_scale(rl: Mapping[str, Any]) -> str:
    """``rl.adv_scale``, with "auto" resolved to the loss preset's scaling (Dr. GRPO: none)."""
    if rl["adv_scale"] != "auto":
        return rl["adv_scale"]
    return LOSS_PRESETS[rl["loss_type"]].adv_scale


def _schedule(section: dict) -> TemperatureSchedule:
    tuples = _tuple(section, "boundaries") | _tuple(section, "levels")
    return TemperatureSchedule(**section | tuples)


def _tuple(section: dict, key: str) -> dict:
    return {key: tuple(section[key])}
