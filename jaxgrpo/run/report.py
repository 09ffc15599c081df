"""What a training run says about itself: the header before its first step and the summary
after its last (``jaxgrpo.rl.run_log`` renders them; this gathers what they name)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax

from jaxgrpo.core.host import cache_off_why
from jaxgrpo.models.aliases import MODEL_ALIASES
from jaxgrpo.rl.run_log import human_count, warn_once
from jaxgrpo.run import plot
from jaxgrpo.run.runtime import RunFiles


def header_info(cfg, learner, data, held_out, start) -> dict[str, Any]:
    """What the run's header (``run_log.run_header``) names: model, task, devices, run
    directory, cache, tools, teacher and asynchronous rollouts."""
    return {
        "model": MODEL_ALIASES.get(cfg.model.source, cfg.model.source),
        "params": learner.programs.n_params,
        "trainable": learner.programs.n_trainable,
        "lora_rank": cfg.model.lora_rank,
        "task": cfg.task.name,
        "train_size": data.size,
        "eval_size": len(held_out.examples),
        "prompts_per_step": cfg.rl.prompts_per_step,
        "group_size": cfg.rl.group_size,
        "steps": cfg.steps,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "mesh": dict(learner.mesh.shape),
        "run_dir": cfg.run_dir,
        "start": start,
        "cache_dir": jax.config.jax_compilation_cache_dir,
        "cache_off_why": cache_off_why(),
        "tools": learner.agent.tools_line if learner.agent is not None else None,
        "teacher": _teacher_line(cfg, learner),
        "rollouts": _rollouts_line(cfg, learner),
    }


def _rollouts_line(cfg, learner) -> str | None:
    """Asynchronous rollouts for the run's header: lag, bound, correction, sampler devices."""
    r = cfg.rl
    if r.max_staleness == 0:
        return None
    bound = (
        "the sampler waits for its weights"
        if r.stale_batches == "wait"
        else "older batches dropped"
    )
    correction = {
        "tis": f"tis (weights capped at {r.lag_cap:g})",
        "mask": f"mask (ratios outside [{r.lag_floor:g}, {r.lag_cap:g}] get no gradient)",
        "clip": "clip (PPO's clip against the sampler's policy)",
    }[r.lag_correction]
    side = learner.sampler_side
    where = "the learner's devices"
    if side.own_devices:
        mesh = " ".join(f"{k}={v}" for k, v in side.mesh.shape.items())
        where = f"{side.mesh.devices.size} devices of its own (mesh {mesh})"
    return (
        f"asynchronous, up to {r.max_staleness} version(s) behind ({bound}); "
        f"correction {correction}; sampled on {where}"
    )


def _teacher_line(cfg, learner) -> str | None:
    """The teacher's source, size and uses, for the run's header."""
    t, p = cfg.teacher, learner.programs
    if not t.enabled:
        return None
    uses = [f"distillation term x {t.distill_coef:g}"] * (t.distill_coef > 0)
    uses += [f"KL target (beta {cfg.rl.beta:g}) in place of the reference"] * p.kl_to_teacher
    return f"{t.source}: {human_count(p.n_teacher_params)} parameters, frozen; " + ", ".join(uses)


def summary_info(cfg, log_dir, step, t_run, held_out, latest) -> dict[str, Any]:
    """What the closing summary names: files written, plots drawn now, the next commands."""
    run_dir = cfg.run_dir
    files = [("metrics", os.path.join(log_dir, "metrics.jsonl"))]
    if cfg.logging.samples_every:
        files.append(("samples", os.path.join(log_dir, "samples.jsonl")))
    if cfg.logging.tensorboard:
        files.append(("tensorboard", os.path.join(log_dir, "tensorboard")))
    try:
        pngs = plot.plot_runs([log_dir], os.path.join(log_dir, "plots"))
        files.append(("plots", f"{pngs[0]} (and {len(pngs) - 1} more PNG)"))
    except Exception as e:  # plots are a convenience: never fail a finished run over them
        warn_once("plot/failed", f"could not draw the run's plots: {e}")
    if latest is not None:
        files.append(("checkpoints", f"{RunFiles.join(run_dir, 'checkpoints')} (step {latest})"))
    commands = [
        f"python -m jaxgrpo.plot {run_dir}",
        f"python -m jaxgrpo.evaluate --checkpoint {run_dir} --base",
        f"python -m jaxgrpo.export {run_dir} {RunFiles.join(run_dir, 'export')}",
    ]
    return {
        "steps": step,
        "seconds": time.perf_counter() - t_run,
        "before": held_out.first,
        "after": held_out.last,
        "files": files,
        "commands": commands,
    }
