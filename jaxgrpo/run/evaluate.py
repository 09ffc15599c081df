"""``python -m jaxgrpo.evaluate``: score trained runs (or a base model) the way the seed study did.

    python -m jaxgrpo.evaluate --config gsm8k_hard.py --checkpoint runs/gsm8k_hard \\
        [--checkpoint runs/other ...] [--base] [--model SOURCE] [--split test] \\
        [--num_samples 8] [--max_examples N] [--tasks jeebench] [--judge SOURCE] [--out FILE] \\
        [--config.eval.judge_prompt="..."]

Each run (a ``--checkpoint`` run directory, or the untrained model with ``--base`` or when no
checkpoint is given) samples ``num_samples`` completions per held-out prompt with the seed
study's settings (512 new tokens, temperature 0.6, top-p 0.95, its prompt from the task) and
is scored by ``jaxgrpo.eval.metrics``: ``strict_accuracy``, ``lenient_accuracy`` and
``format_rate`` (``jaxgrpo.grading.accuracy``'s definitions, the names the training logs use),
pass@k (strict) for every k <= n, mean@n, lengths split by correctness, truncation and doom-loop
rates.
An optional judge (any ``load_model`` source) answers yes/no, greedily, whether a completion
reaches the reference.

The sampling settings and the judge come from the config's ``eval`` section (``num_samples``,
``max_new_tokens``, ``temperature``, ``top_p``, ``batch_size``, ``judge_source``,
``judge_prompt``; defaults in ``configs/base.py``). ``--config.eval.KEY=VALUE`` sets one like any
other config key; the flags ``--num_samples``, ``--max_new_tokens``, ``--temperature``,
``--top_p``, ``--batch_size``, ``--judge`` (= ``judge_source``) and ``--judge_prompt`` override
both. Every value is validated with the rest of the config: an unknown key or a bad value fails
naming the key. With several run directories and no ``--config``, the last one's
``config.json`` gives the ``eval`` section.

Output: a JSON file with every figure and per-sample record, the same table as Markdown next
to it (``.md``), and the table printed: one row per run, the seed study's columns (task x
strict / lenient / pass@n, then strict for each ``--tasks`` task).

The config gives the model, the task and the mesh; without ``--config`` a run directory's own
``config.json`` is used. Prompts are sharded over the mesh's (data, fsdp) axes as in training;
on a multi-host slice every process runs this command (``launch/run_pod.sh`` style) and process
0 writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
from etils import epath
from tqdm.auto import tqdm

from jaxgrpo.agents import Agent
from jaxgrpo.agents.episode import turn_records
from jaxgrpo.core.errors import UserError
from jaxgrpo.core.host import prepare_cli
from jaxgrpo.data import TASKS
from jaxgrpo.data.base import RowTask
from jaxgrpo.eval import metrics
from jaxgrpo.eval.completions import Settings, sample, sample_episodes
from jaxgrpo.rewards.inputs import reward_inputs
from jaxgrpo.rl.step_metrics import agent_metrics
from jaxgrpo.run.build import (
    build_mesh,
    build_rewards,
    build_task,
    load_policy,
    restore_params,
    start_distributed,
)
from jaxgrpo.run.judge import make_judge
from jaxgrpo.settings.loading import parse_known_overrides, run_config

# ----------------------------------------------------------------------------------------------
# Evaluation of runs.


def task_examples(cfg: Any, name: str | None, data: str | None, settings: Settings) -> tuple:
    """(task name, examples) of the config's task or of ``name``, on ``settings.split``.

    Args:
      cfg: the run's ``TrainConfig`` (prompt template and system prompt carry over).
      name: another task (e.g. ``jeebench``), or None for the config's.
      data: the task's ``source`` (a local file, a hub id or ``fixture``), or None.
      settings: split and ``max_examples``.
    """
    task_cfg = cfg.task
    kwargs = {} if name and name != task_cfg.name else dict(task_cfg.kwargs)
    if data:
        kwargs["source"] = data
    name = name or task_cfg.name
    # A data set's held-out split is all its rows; a generated task's (format_copy, arithmetic)
    # is the run's `task.num_eval` draws, the prompts it was evaluated on while training.
    whole = 10**9 if issubclass(TASKS.get(name, RowTask), RowTask) else task_cfg.num_eval
    task_cfg = dataclasses.replace(
        task_cfg, name=name, kwargs=kwargs, num_eval=settings.max_examples or whole
    )
    if name != cfg.task.name:
        task_cfg = dataclasses.replace(task_cfg, prompt_template="", system_prompt="")
    task = build_task(task_cfg)
    examples = task.eval_examples() if settings.split == "test" else task.train_examples(cfg.seed)
    return task_cfg.name, list(examples)[: settings.max_examples]


def evaluate_examples(
    model,
    tokenizer,
    examples,
    settings,
    mesh,
    judge_fn=None,
    reward_set=None,
    *,
    step=0,
    max_steps=0,
    agent=None,
) -> tuple:
    """(summary, records) of one model on one task's examples.

    With ``reward_set`` every completion is also scored by the run's reward functions, called
    as in training (``jaxgrpo.rewards.reward_inputs``; ``trainer_state.global_step`` is
    ``step``, the checkpoint's): each record gets ``reward`` and ``rewards`` (None where a
    function could not score), the summary ``reward_mean`` and ``reward/<fn>/mean``. With an
    ``agent`` (a run with tools) each completion is an episode run as in training (its tools,
    environment and limits): each record gets its ``turns``, the summary ``agent/*``.
    """
    messages = [ex["messages"] for ex in examples]
    with tqdm(
        total=len(messages),
        desc="evaluate",
        unit="prompt",
        file=sys.stderr,
        disable=jax.process_index() != 0,
    ) as bar:
        if agent is None:
            out = sample(model, tokenizer, messages, settings, mesh, progress=bar.update)
        else:
            out = sample_episodes(model, agent, examples, settings, mesh, progress=bar.update)
    graded = out.get("model_texts", out["texts"])  # what the model wrote, not the tools
    records = metrics.score_samples(
        out["texts"],
        [ex.get("answer") for ex in examples],
        settings.num_samples,
        lengths=out["lengths"],
        truncated=out["truncated"],
        tokens=out["tokens"],
        verifiers=[ex.get("verifier") for ex in examples],
        model_completions=graded,
        model_tokens=out.get("model_tokens"),
    )
    if judge_fn is not None:
        for record, verdict in zip(records, judge_fn(examples, graded), strict=True):
            record["judge"] = bool(verdict)
    summary = metrics.summarize(records, settings.num_samples)
    g = settings.num_samples
    chats = messages if agent is None else out["chats"]
    if agent is not None:
        for record, episode in zip(records, out["episodes"], strict=True):
            record["turns"] = turn_records(episode)
        lengths, model_tokens = out["lengths"], out["model_tokens"]
        summary.update(agent_metrics(out["episodes"], lengths, model_tokens))
    if reward_set is not None:
        if agent is None:
            prompts = [tokenizer.apply_chat_template(m) for m in chats for _ in range(g)]
        else:  # as the episodes saw them: with the tools where the template renders them
            prompts = [p for p in out["prompts"] for _ in range(g)]
        inputs = reward_inputs(
            examples,
            g,
            prompts,
            out["texts"],
            out["tokens"],
            step=step,
            max_steps=max_steps,
            episodes=out.get("episodes"),
            environments=out.get("environments"),
            prompt_messages=None if agent is None else [m for m in chats for _ in range(g)],
        )
        summary.update(metrics.add_rewards(records, *reward_set.score(inputs)[:2]))
    return summary, records


def eval_settings(cfg: Any, args: argparse.Namespace) -> Settings:
    """The ``Settings`` of a command line: the config's ``eval`` section (flags already applied
    to it as overrides; ``every`` is the trainer's) plus the split, example cap and seed."""
    given = {k: getattr(args, k) for k in ("split", "seed") if getattr(args, k) is not None}
    return Settings.from_config(cfg.eval, max_examples=args.max_examples, **given)


def evaluate_runs(args: argparse.Namespace) -> tuple[dict[str, Any], Settings]:
    """Every run of the command line on every task: (``{label: {"tasks": {...}, ...}}``, the
    settings used)."""
    runs = [(None, "base")] if args.base or not args.checkpoint else []
    runs += [(d, os.path.basename(os.path.normpath(d))) for d in args.checkpoint or []]
    overrides = dict(args.overrides)
    cfg0 = run_config(args.config, runs[-1][0], overrides)
    start_distributed(cfg0)
    mesh = build_mesh(cfg0)
    settings = eval_settings(cfg0, args)
    judge_fn = make_judge(cfg0, settings, mesh) if settings.judge_source else None
    tasks = [(None, args.data)] + [_task_spec(t) for t in args.tasks or []]
    results: dict[str, Any] = {}
    models: dict = {}
    for run_dir, label in runs:
        cfg = run_config(args.config, run_dir, overrides) if run_dir else cfg0
        model, tokenizer, reward_set, step, agent = load_scored_policy(
            cfg, run_dir, mesh, args.model, models
        )
        entry: dict[str, Any] = {"checkpoint": run_dir, "step": step, "tasks": {}}
        for name, data in tasks:
            task_name, examples = task_examples(cfg, name, data, settings)
            # Another task's examples lack the columns the run's rewards read.
            scorer = reward_set if name is None or name == cfg.task.name else None
            summary, records = evaluate_examples(
                model,
                tokenizer,
                examples,
                settings,
                mesh,
                judge_fn,
                scorer,
                step=step,
                max_steps=cfg.steps,
                agent=agent,
            )
            entry["tasks"][task_name] = {"summary": summary, "records": records}
        results[_unique(label, results)] = entry
    return results, settings


def load_scored_policy(cfg: Any, run_dir: str | None, mesh, model_source=None, cache=None):
    """(model, tokenizer, reward set, step, agent): ``build.load_policy``'s trained policy, the
    run's reward functions (model-based ones bound to the untrained model) and its ``Agent``
    (None without tools), as in training."""
    model, tokenizer, _ = load_policy(cfg, None, mesh, model_source, cache=cache)
    agent = Agent.from_config(cfg.agent, tokenizer)
    reward_set = build_rewards(cfg.rewards, model, tokenizer, agent, mesh)
    step = restore_params(cfg, model, tokenizer, run_dir, mesh) if run_dir else 0
    return model, tokenizer, reward_set, step, agent


def _unique(label: str, taken: dict) -> str:
    out, i = label, 2
    while out in taken:
        out, i = f"{label}-{i}", i + 1
    return out


def _task_spec(text: str) -> tuple[str, str | None]:
    """``name`` or ``name:source`` (e.g. ``jeebench:fixture``)."""
    name, _, source = text.partition(":")
    return name, source or None


def write(results: dict[str, Any], settings: Settings, path: str) -> str:
    """Writes ``path`` (JSON: settings, every figure, per-sample records) and ``path``'s
    ``.md`` twin (the table); returns the table."""
    markdown = metrics.results_table(results)
    out = epath.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"settings": dataclasses.asdict(settings), "runs": results}, indent=1)
    )
    out.with_suffix(".md").write_text(markdown)
    return markdown


# ----------------------------------------------------------------------------------------------
# Command line.


# Flags that set a key of the config's ``eval`` section (flag name -> key).
EVAL_FLAGS = {
    "num_samples": "num_samples",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "batch_size": "batch_size",
    "judge": "judge_source",
    "judge_prompt": "judge_prompt",
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments; ``args.overrides`` holds (dotted key, value) pairs: ``--config.a.b=v`` in
    order, then the ``EVAL_FLAGS`` given (so a flag wins over ``--config.eval.*``)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxgrpo.evaluate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", help="config file or shipped name (default: RUN_DIR/config.json)")
    p.add_argument("--checkpoint", action="append", help="run directory (repeatable)")
    p.add_argument("--base", action="store_true", help="also evaluate the untrained model")
    p.add_argument("--model", help="model source replacing the config's model.source")
    p.add_argument("--split", choices=("test", "train"), help="held-out (default) or train")
    p.add_argument("--num_samples", type=int, help="completions per prompt (eval.num_samples)")
    p.add_argument("--max_new_tokens", type=int, help="eval.max_new_tokens")
    p.add_argument("--temperature", type=float, help="eval.temperature")
    p.add_argument("--top_p", type=float, help="eval.top_p")
    p.add_argument("--max_examples", type=int, help="evaluate at most N prompts per task")
    p.add_argument("--batch_size", type=int, help="prompts per batch (eval.batch_size)")
    p.add_argument("--seed", type=int, help="sampling seed (default 0)")
    p.add_argument("--data", help="the task's data source (file, hub id or 'fixture')")
    p.add_argument("--tasks", nargs="*", help="more tasks, NAME or NAME:SOURCE (jeebench)")
    p.add_argument("--judge", help="judge model source, yes/no per completion (eval.judge_source)")
    p.add_argument("--judge_prompt", help="{question} {reference} {completion} (eval.judge_prompt)")
    p.add_argument("--out", help="JSON output (default RUN_DIR/eval_SPLIT.json or eval.json)")
    args, args.overrides = parse_known_overrides(p, argv)
    flags = [(f"eval.{key}", getattr(args, flag)) for flag, key in EVAL_FLAGS.items()]
    args.overrides += [(k, v) for k, v in flags if v is not None]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: evaluate, write the JSON and Markdown (process 0), print the table."""
    prepare_cli()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        results, settings = evaluate_runs(args)
    except (UserError, OSError, ValueError) as e:  # what the code understood: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        single = args.checkpoint[0] if args.checkpoint and len(args.checkpoint) == 1 else None
        default = f"{single.rstrip('/')}/eval_{settings.split}.json" if single else "eval.json"
        path = args.out or default
        print(write(results, settings, path), end="")
        print(f"wrote {path} and {os.path.splitext(path)[0]}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
