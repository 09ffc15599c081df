"""Metric sinks (JSONL, TensorBoard, Weights & Biases), sample dumps, progress bar, dead-run alarms.

Only process 0 writes anything: every other process gets the same objects, whose methods do
nothing, so callers never branch on the process index.

Metric keys the progress bar and the dead-run check read (the learner writes them):

    reward/mean, reward/std       total reward over the step's completions
    kl/mean                       mean per-token KL(pi || pi_ref)
    completion/truncated_frac     fraction of completions that hit max_new_tokens
    time/sampling, time/rewards, time/reference, time/update   seconds in each phase of a step
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
KL_MEAN = "kl/mean"
ACCURACY = "strict_accuracy"
TRUNCATED_FRAC = "completion/truncated_frac"
TIME_KEYS = ("time/sampling", "time/rewards", "time/reference", "time/teacher", "time/update")

_WARNED: set[str] = set()


def console(message: str, *, error: bool = False) -> None:
    """Prints one line for the user (stdout, or stderr with ``error``) without breaking a
    progress bar that is being drawn."""
    tqdm.write(message, file=sys.stderr if error else sys.stdout)
    (sys.stderr if error else sys.stdout).flush()


def warn_once(key: str, message: str) -> bool:
    """Prints ``warning: message`` to stderr the first time ``key`` is seen.

    Returns:
      True if the warning was printed now, False if it had been printed before.
    """
    if key in _WARNED:
        return False
    _WARNED.add(key)
    console(f"warning: {message}", error=True)
    return True


def check_dead_run(step: int, metrics: Mapping[str, Any]) -> list[str]:
    """Warns once when a step looks dead although its loss may look healthy.

    A step is dead when every completion was truncated (the model never stops), or when every
    reward in the batch is identical (all advantages are 0, so nothing is learned) without every
    completion being correct and without a distillation term (whose per-token advantages do not
    come from the rewards); a batch where every completion is correct is reported as solved.

    Returns:
      The keys of the warnings that fired at this call.
    """
    fired = []
    truncated = metrics.get(TRUNCATED_FRAC)
    if truncated is not None and float(truncated) >= 1.0:
        msg = (
            f"step {step}: every completion was truncated at max_new_tokens: the rewards see "
            "no finished answer. Raise sampling.max_new_tokens or check the stop tokens."
        )
        if warn_once("dead_run/truncated", msg):
            fired.append("dead_run/truncated")
    reward_std = metrics.get(REWARD_STD)
    # A distillation term gives every token an advantage of its own, whatever the rewards.
    distilling = metrics.get("distill_reverse_kl") is not None
    if reward_std is not None and float(reward_std) == 0.0 and not distilling:
        if metrics.get(ACCURACY) is not None and float(metrics[ACCURACY]) >= 1.0:
            # Every completion is correct: the batch is solved, which is success, not a dead run.
            if "dead_run/solved" not in _WARNED:
                _WARNED.add("dead_run/solved")
                console(
                    f"step {step}: every completion of the batch is correct (solved); such "
                    "batches have zero advantages and leave the policy where it is."
                )
                fired.append("dead_run/solved")
        else:
            msg = (
                f"step {step}: every reward in the batch is identical, so every advantage is 0 "
                "and the policy does not move (the loss still looks fine). Use a reward with "
                "partial credit, more samples per prompt, or rl.dynamic_sampling."
            )
            if warn_once("dead_run/constant_reward", msg):
                fired.append("dead_run/constant_reward")
    return fired


def _scalar(value: Any) -> float | int | str | None:
    """Python scalar for JSON: arrays of size 1 unwrapped, NaN/Inf as None (strict JSON)."""
    if isinstance(value, str | bool) or value is None:
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric values must be scalars, got shape {arr.shape}")
    item = arr.reshape(()).item()
    if isinstance(item, float) and not math.isfinite(item):
        return None
    return item


def truncate_jsonl(path: str, max_step: int) -> None:
    """Drops lines whose ``step`` exceeds ``max_step`` (they will be re-run after a resume)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= max_step]
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)


class MetricsLogger:
    """Writes ``metrics.jsonl`` (one object per step), TensorBoard, W&B and ``samples.jsonl``."""

    def __init__(
        self,
        run_dir: str,
        process_index: int = 0,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "jaxgrpo",
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        """Args:
        run_dir: output directory (created).
        process_index: this process's index; only 0 writes.
        tensorboard: also write TensorBoard events to ``run_dir/tensorboard``.
        wandb: also log to Weights & Biases, if the package is installed.
        wandb_project: W&B project.
        config: run config snapshot for W&B.
        resume_step: when resuming from a checkpoint at this step, existing lines for later
          steps are dropped so the re-run steps are not logged twice.
        """
        self.active = process_index == 0
        self.run_dir = run_dir
        self._tb = self._wandb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.samples_path = os.path.join(run_dir, "samples.jsonl")
        if resume_step is not None:
            truncate_jsonl(self.metrics_path, resume_step)
            truncate_jsonl(self.samples_path, resume_step)
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        self._samples_file = open(self.samples_path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            # Local: tensorboardX loads protobuf; only runs that log to TensorBoard need it.
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.path.join(run_dir, "tensorboard"))
        if wandb:
            self._wandb = _init_wandb(run_dir, wandb_project, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one step's scalar metrics to every enabled sink."""
        if not self.active:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: _scalar(v) for k, v in metrics.items()})
        self._metrics_file.write(json.dumps(row) + "\n")
        self._metrics_file.flush()
        numeric = {
            k: v
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "time")
        }
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        """Appends sample completions (prompt, completion, rewards, ...) to ``samples.jsonl``."""
        if not self.active:
            return
        for sample in samples:
            # The logger's step (completed steps, as in metrics.jsonl) wins over the sample's
            # own: a resumed run truncates both files by it.
            row = {**{k: _jsonable(v) for k, v in sample.items()}, "step": int(step)}
            self._samples_file.write(json.dumps(row) + "\n")
        self._samples_file.flush()

    def close(self) -> None:
        """Flushes and closes every sink."""
        if not self.active:
            return
        self._metrics_file.close()
        self._samples_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, str | bool) or value is None:
        return value
    if isinstance(value, list | tuple) or (hasattr(value, "shape") and np.ndim(value) > 0):
        return [_jsonable(v) for v in value]
    return _scalar(value)


def _init_wandb(run_dir: str, project: str, config: Mapping[str, Any] | None):
    try:  # wandb is optional (not a dependency): imported only when a run asks for it
        import wandb
    except ImportError:
        warn_once("wandb/missing", "logging.wandb=True but wandb is not installed; skipping W&B")
        return None
    name = os.path.basename(os.path.abspath(run_dir))
    return wandb.init(project=project, name=name, dir=run_dir, config=dict(config or {}))


class ProgressBar:
    """tqdm bar: step, reward, train accuracy, KL, and seconds per step split into sampling /
    rewards / update."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = None
        if enabled:
            self._bar = tqdm(
                total=total, initial=initial, desc="train", dynamic_ncols=True, file=sys.stdout
            )

    @staticmethod
    def describe(metrics: Mapping[str, Any]) -> str:
        """Postfix text, e.g. ``reward=0.41 acc=0.34 kl=0.0030 s=4.2 (sample 2.1|update 2.0)``."""
        parts = []
        if REWARD_MEAN in metrics:
            parts.append(f"reward={float(metrics[REWARD_MEAN]):.3f}")
        if metrics.get(ACCURACY) is not None:
            parts.append(f"acc={float(metrics[ACCURACY]):.2f}")
        if KL_MEAN in metrics:
            parts.append(f"kl={float(metrics[KL_MEAN]):.4f}")
        for key, value in metrics.items():  # reward/<fn>/failed_frac: samples a fn cannot score
            name = key.removeprefix("reward/").removesuffix("/failed_frac")
            if key.startswith("reward/") and key.endswith("/failed_frac") and float(value) > 0:
                parts.append(f"{name} failed={float(value):.2f}")
        times = [float(metrics[k]) if k in metrics else None for k in TIME_KEYS]
        if any(t is not None for t in times):
            names = ("sample", "reward", "ref", "teacher", "update")
            split = "|".join(
                f"{name} {t:.1f}"
                for name, t in zip(names, times, strict=True)
                # no reference pass at beta = 0, no teacher without one
                if t is not None and (t > 0 or name not in ("ref", "teacher"))
            )
            parts.append(f"s={sum(t for t in times if t is not None):.1f} ({split})")
        return " ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Moves the bar to ``step`` and shows ``metrics``' summary."""
        if self._bar is None:
            return
        self._bar.set_postfix_str(self.describe(metrics), refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------------------------
# What a run prints: its header, held-out evaluations and closing summary.

STRICT = "strict_accuracy"
LENIENT = "lenient_accuracy"


def human_count(n: float) -> str:
    """``134515008`` -> ``"134.5M"``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def human_seconds(seconds: float) -> str:
    """``499`` -> ``"8 min 19 s"``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def run_header(info: Mapping[str, Any]) -> str:
    """The lines a run prints before its first step: model, task, devices, run directory.

    Args:
      info: ``model``, ``params``, ``trainable``, ``lora_rank``, ``task``, ``train_size``,
        ``eval_size``, ``prompts_per_step``, ``group_size``, ``steps``, ``devices``,
        ``platform``, ``mesh`` (axis -> size), ``run_dir``, ``start`` (completed steps),
        ``cache_dir`` (or None) and optionally ``cache_off_why`` (" (why)" it is off),
        ``tools`` (``Agent.tools_line``: the tools and how the model is told of them),
        ``teacher`` (the teacher's source, parameters and what it is used for) and
        ``rollouts`` (asynchronous rollouts: the lag, its bound and correction, the sampler's
        devices).
    """
    tuning = (
        f"LoRA rank {info['lora_rank']}, {human_count(info['trainable'])} trainable"
        if info["lora_rank"]
        else "full fine-tuning"
    )
    mesh = " ".join(f"{k}={v}" for k, v in info["mesh"].items())
    resume = f"resuming at step {info['start']}" if info["start"] else "new run"
    per_step = f"{info['prompts_per_step']} prompts x {info['group_size']} samples per step"
    lines = [
        f"model    {info['model']}: {human_count(info['params'])} parameters, {tuning}",
        f"task     {info['task']}: {info['train_size']} training / {info['eval_size']} held-out "
        f"examples; {per_step}, {info['steps']} steps",
        f"devices  {info['devices']} x {info['platform']}, mesh {mesh}",
        f"run dir  {os.path.abspath(info['run_dir'])} ({resume})",
        f"cache    {info['cache_dir']} (compiled programs, reused by later runs)"
        if info["cache_dir"]
        else f"cache    off{info.get('cache_off_why', '')}",
    ]
    if info.get("tools"):
        lines.append(f"tools    {info['tools']}")
    if info.get("teacher"):
        lines.append(f"teacher  {info['teacher']}")
    if info.get("rollouts"):
        lines.append(f"rollouts {info['rollouts']}")
    return "\n".join(lines)


def _fraction(metrics: Mapping[str, Any], key: str) -> str:
    value, n = metrics.get(key), metrics.get("num_examples")
    if value is None:
        return "n/a"
    if n:
        return f"{round(float(value) * float(n))}/{int(n)} ({100 * float(value):.1f}%)"
    return f"{100 * float(value):.1f}%"


def eval_line(label: str, metrics: Mapping[str, Any], seconds: float | None = None) -> str:
    """One line for a held-out evaluation: ``held-out at step 5: strict 12/64 (18.8%), ...``."""
    text = f"held-out {label}: strict {_fraction(metrics, STRICT)}"
    if LENIENT in metrics:
        text += f", lenient {_fraction(metrics, LENIENT)}"
    if seconds is not None:
        text += f" [{human_seconds(seconds)}]"
    return text


def run_summary(info: Mapping[str, Any]) -> str:
    """The lines a run prints when it ends: accuracy before -> after, time, files, next commands.

    Args:
      info: ``steps``, ``seconds``, ``before`` and ``after`` (eval metrics or None),
        ``files`` ((label, path) pairs) and ``commands`` (shell lines).
    """
    lines = [f"done: {info['steps']} steps in {human_seconds(info['seconds'])}"]
    before, after = info.get("before"), info.get("after")
    if before and after:
        lines.append(
            f"held-out strict accuracy {_fraction(before, STRICT)} -> {_fraction(after, STRICT)}"
        )
    lines += [f"  {name:<12}{path}" for name, path in info["files"]]
    lines.append("next:")
    lines += [f"  {command}" for command in info["commands"]]
    return "\n".join(lines)
