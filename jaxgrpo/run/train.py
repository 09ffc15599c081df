"""``python -m jaxgrpo.train --config CONFIG [--config.section.key=value ...]``: a GRPO run.

Wires the parts and owns no math: config -> distributed runtime -> mesh -> model and tokenizer
-> task -> rewards -> ``Learner`` -> the step loop with its data cursor, checkpoints, metrics,
sample dumps, progress bar and held-out evaluation before and after training.

``CONFIG`` is a path to a config file, or the bare name of a shipped one (``format_copy``,
``gsm8k_hard.py``, ...) when no such path exists. Rerunning in the same ``run_dir`` continues
from its latest checkpoint. SIGTERM or a first Ctrl-C finishes the current step, saves a
checkpoint and exits; a second Ctrl-C stops at once.

The parts (model, task, rewards) are built by ``jaxgrpo.run.build``, which names the model
source aliases.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from jaxgrpo.core.errors import ConfigError, one_line_errors
from jaxgrpo.core.host import prepare_cli
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.rl.pipeline import RolloutPipeline
from jaxgrpo.rl.run_log import (
    MetricsLogger,
    ProgressBar,
    check_dead_run,
    console,
    eval_line,
    run_header,
    run_summary,
    warn_once,
)
from jaxgrpo.run.build import RunParts, build_parts, start_distributed
from jaxgrpo.run.report import header_info, summary_info
from jaxgrpo.run.runtime import DataStream, RunFiles, StopRequest, fault_point
from jaxgrpo.settings import loading
from jaxgrpo.settings.checks import unknown_key_error
from jaxgrpo.settings.schema import TrainConfig, to_train_config

# ----------------------------------------------------------------------------------------------
# The loop.


def _prefixed(metrics: dict, prefix: str) -> dict:
    return {k if k.startswith(prefix) else prefix + k: v for k, v in metrics.items()}


class HeldOut:
    """The held-out evaluation of a run: before training, every ``eval.every`` steps, at the end.

    Each evaluation is printed as one line and returned as ``eval/*`` metrics and its seconds
    (``time/eval``), which the loop writes into that step's metrics row (step 0: a row of its
    own).
    """

    def __init__(self, cfg: TrainConfig, learner: Any, task: Any, say: Any):
        self.examples = list(task.eval_examples())[: cfg.task.num_eval]
        self.learner, self.every, self.steps, self.say = learner, cfg.eval.every, cfg.steps, say
        self.first: dict | None = None
        self.last: dict | None = None

    def due(self, step: int) -> bool:
        """Whether completed step ``step`` (0 = before training) is evaluated."""
        if not self.examples:
            return False
        return step in (0, self.steps) or (self.every > 0 and step % self.every == 0)

    def __call__(self, state: Any, step: int) -> dict:
        t0 = time.perf_counter()
        metrics = self.learner.evaluate(state, self.examples)
        seconds = time.perf_counter() - t0
        label = "before training" if step == 0 else f"at step {step}"
        self.say(eval_line(label, metrics, seconds))
        self.first = self.first or metrics
        self.last = metrics
        return {**_prefixed(metrics, "eval/"), "time/eval": seconds}


def run(cfg: TrainConfig, parts: RunParts | None = None) -> dict[str, Any]:
    """Trains ``cfg.steps`` steps (resuming from ``cfg.run_dir`` when it holds a checkpoint).

    Args:
      cfg: the run.
      parts: a prebuilt `RunParts` (tests, notebooks); None builds them.

    Returns:
      The last step's metrics (with ``eval/*`` after the final step), ``{}`` if nothing ran.
    """
    t_run = time.perf_counter()
    if parts is None:
        start_distributed(cfg)  # before anything below starts JAX's backend
        if jax.process_index() == 0:
            console(f"building {cfg.model.source} for task {cfg.task.name} ...")
        parts = build_parts(cfg)
    process = jax.process_index()
    say = console if process == 0 else (lambda *_: None)
    learner, task = parts.learner, parts.task
    files = RunFiles(cfg.run_dir, process)
    ckpt = Checkpointer(
        files.join(cfg.run_dir, "checkpoints"),
        every=cfg.checkpoint.every,
        keep=cfg.checkpoint.keep,
    )
    state, start, cursor, held = _restore_or_init(cfg, learner, ckpt)
    logger = _open_logger(cfg, files.local_dir, process, start)
    data = DataStream(task, cfg.seed, cursor)
    held_out = HeldOut(cfg, learner, task, say)
    say(run_header(header_info(cfg, learner, data, held_out, start)))
    if start == 0 and held_out.due(0):
        logger.log(0, held_out(state, 0))
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and process == 0)
    metrics: dict[str, Any] = {}
    step = start
    pipeline = None
    if cfg.rl.max_staleness > 0 and start < cfg.steps:
        pipeline = RolloutPipeline(learner, data, state, start, cfg.steps, held)

    def save(force: bool = False) -> bool:
        # Asynchronous rollouts: the data cursor before the next batch to train, and the
        # weights of the versions that sample the batches in flight.
        if not (force or ckpt.should_save(step)):
            return False
        cursor = data.position if pipeline is None else pipeline.cursor()
        held = None if pipeline is None else pipeline.held_versions(step)
        return ckpt.save(step, state, _meta(cfg, step, cursor), force=force, sampler=held)

    try:
        with StopRequest() as stop:
            while step < cfg.steps and not stop.agreed():
                t0 = time.perf_counter()
                if pipeline is None:
                    # `draw` refills groups under dynamic sampling; it advances the same cursor.
                    examples = data.take(cfg.rl.prompts_per_step)
                    state, metrics, samples = learner.step(state, examples, draw=data.take)
                else:
                    state, metrics, samples = pipeline.train_step(state)
                step += 1
                metrics = {**metrics, "time/step": time.perf_counter() - t0}
                check_dead_run(step, metrics)
                if held_out.due(step):
                    metrics.update(held_out(state, step))
                # Rows before the checkpoint: a run killed between the two resumes from the
                # previous checkpoint, whose later rows the logger drops and the rerun writes
                # again, so every step up to the last checkpoint is logged exactly once.
                _record(cfg, logger, bar, step, metrics, samples)
                fault_point("logged", step)
                if save():
                    files.upload()
    finally:
        if step > start:
            try:
                save(force=True)
            except Exception as e:  # an interrupted step may have donated (deleted) the state
                warn_once("checkpoint/exit", f"could not checkpoint step {step} at exit: {e!r}")
        if pipeline is not None:
            pipeline.close()
        latest = ckpt.latest_step()
        ckpt.close()
        bar.close()
        logger.close()
        files.upload()
    if process == 0 and step > start:
        say(run_summary(summary_info(cfg, files.local_dir, step, t_run, held_out, latest)))
    return metrics


def _record(cfg: TrainConfig, logger, bar, step: int, metrics: dict, samples: list) -> None:
    """Metrics (every ``logging.every`` steps and the last), samples, progress bar."""
    if step % cfg.logging.every == 0 or step == cfg.steps:
        logger.log(step, metrics)
    every = cfg.logging.samples_every
    if samples and every and step % every == 0:
        logger.log_samples(step, samples)
    bar.update(step, metrics)


def _open_logger(cfg: TrainConfig, log_dir: str, process: int, start: int):
    """Metrics sinks (lines of steps after ``start`` dropped) and the config snapshot."""
    logger = MetricsLogger(
        log_dir,
        process,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        config=cfg.to_dict(),
        resume_step=start if start > 0 else -1,
    )
    if process == 0:
        with open(os.path.join(log_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=1)
    return logger


def _meta(cfg: TrainConfig, step: int, cursor: int) -> dict[str, Any]:
    # Curricula and the temperature schedule are functions of the step, so the step (in the
    # state and here) is their whole state; the data cursor is the rest.
    return {"step": step, "data_cursor": cursor, "config": cfg.to_dict()}


def _restore_or_init(cfg: TrainConfig, learner: Any, ckpt: Any) -> tuple[Any, int, int, dict]:
    """(state, completed steps, data cursor, version -> params of the batches in flight):
    from the latest checkpoint, or fresh."""
    state = learner.init_state()
    latest = ckpt.latest_step()
    if latest is None:
        return state, 0, 0, {}
    if not cfg.resume:
        raise ConfigError(
            f"config key 'resume' = False but {cfg.run_dir!r} already holds checkpoints "
            f"(latest step {latest}); set --config.resume=True or choose another run_dir"
        )
    held = ckpt.restore_sampler(state.params, latest) if cfg.rl.max_staleness > 0 else {}
    state, meta = ckpt.restore(state, latest)
    return state, latest, int(meta["data_cursor"]), held


# ----------------------------------------------------------------------------------------------
# Command line.


def _config_value(argv: Sequence[str]) -> tuple[int, str | None]:
    """(index in argv, value) of ``--config``/``-config`` (``=v`` or separate), or (-1, None)."""
    for i, arg in enumerate(argv):
        match = re.fullmatch(r"--?config(=(.*))?", arg)
        if match:
            if match.group(1) is not None:
                return i, match.group(2)
            return i, argv[i + 1] if i + 1 < len(argv) else None
    return -1, None


def resolve_argv(argv: Sequence[str]) -> list[str]:
    """Rewrites ``--config NAME`` to a file path and checks every ``--config.a.b`` key exists.

    Raises:
      ConfigError: missing config file (listing the shipped ones) or unknown override key.
    """
    argv = list(argv)
    i, value = _config_value(argv)
    if value is None:
        raise ConfigError(
            "--config is required, e.g. --config format_copy; shipped configs: "
            + ", ".join(loading.shipped_configs())
        )
    path = loading.resolve_config_path(value)
    if argv[i].startswith("--config=") or argv[i].startswith("-config="):
        argv[i] = f"--config={path}"
    else:
        argv[i + 1] = path
    cfg = loading.load_config_dict(path)
    for arg in argv:
        match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
        if match and not match.group(1).startswith(loading.TASK_KWARGS):
            parent, key = cfg, match.group(1)
            for part in key.split("."):
                if not hasattr(parent, "keys") or part not in parent:
                    raise unknown_key_error(key, parent, part)
                parent = parent[part]
    return argv


def split_task_kwargs(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Takes ``--config.task.kwargs.<name>=<value>`` (or ``... <value>``) out of ``argv``.

    The task's own arguments are not keys of the locked config file, so absl would reject
    them; ``main`` sets them after parsing (``config.set_task_kwargs``) and validation checks
    them against the task's fields.

    Returns:
      (the other arguments, ``{name: value text}``).
    """
    rest, kwargs, args = [], {}, list(argv)
    prefix = re.compile(r"--?config\." + re.escape(loading.TASK_KWARGS) + r"(\w+)(=(.*))?$")
    while args:
        arg = args.pop(0)
        match = prefix.match(arg)
        if not match:
            rest.append(arg)
        elif match.group(2) is not None:
            kwargs[match.group(1)] = match.group(3)
        elif args:
            kwargs[match.group(1)] = args.pop(0)
        else:
            raise ConfigError(f"{arg} needs a value")
    return rest, kwargs


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry: resolves the config, parses overrides with absl, validates, trains."""
    prepare_cli()
    argv = list(sys.argv if argv is None else argv)
    try:
        argv, task_kwargs = split_task_kwargs(argv)
        argv = resolve_argv(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    flag = config_flags.DEFINE_config_file(
        "config", None, "config file or shipped config name", lock_config=True, sys_argv=argv
    )

    def _run(_):
        if not any(re.match(r"--?(v|verbosity)(=|$)", a) for a in argv):
            # orbax logs every save at INFO; keep the console to the progress bar and warnings.
            absl_logging.set_verbosity(absl_logging.WARNING)
        try:
            loading.set_task_kwargs(flag.value, task_kwargs)
            cfg = to_train_config(flag.value)
        except ConfigError as e:
            sys.exit(f"error: {e}")
        # Bad input found while running (a missing file, a malformed data row, a missing
        # optional package, a reward that fails every sample): one line, no traceback.
        with one_line_errors():
            run(cfg)

    def _parse(args):
        try:
            return flags.FLAGS(args)
        except (flags.Error, TypeError, ValueError) as e:
            sys.exit(f"error: {e}")

    app.run(_run, argv=argv, flags_parser=_parse)


if __name__ == "__main__":
    main()
