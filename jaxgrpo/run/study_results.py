"""A study's evaluation and results: each arm's (and the base model's) held-out evaluation
under the study's one protocol, cached per arm, and ``results.md``'s table and the overlaid
plots (``jaxgrpo.run.study`` runs the arms)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxgrpo.settings.schema import TrainConfig

if TYPE_CHECKING:  # the study's type only: the driver lies above its results
    from jaxgrpo.run.study import Study


def trained_step(cfg: TrainConfig) -> int:
    """The step of the arm's latest checkpoint (0 when it has none)."""
    from jaxgrpo.rl.checkpoint import Checkpointer

    path = os.path.join(cfg.run_dir, "checkpoints")
    if not os.path.isdir(path):
        return 0
    ckpt = Checkpointer(path, every=0, keep=cfg.checkpoint.keep)
    try:
        return ckpt.latest_step() or 0
    finally:
        ckpt.close()


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, data: Any) -> None:
    """Writes ``path`` through a temporary file, so a killed study never leaves half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


class Evaluator:
    """Held-out evaluation under one protocol (the base config's ``eval`` section), for the base
    model and each arm's last checkpoint; each result is cached as ``eval_test.json`` in its
    directory and reused when its protocol and step match."""

    def __init__(self, cfg: TrainConfig):
        from jaxgrpo.eval.completions import Settings
        from jaxgrpo.run.build import build_mesh

        self.mesh = build_mesh(cfg)
        self.settings = Settings.from_config(cfg.eval, max_examples=cfg.task.num_eval)
        self.models: dict = {}

    def __call__(
        self, label: str, cfg: TrainConfig, run_dir: str | None, out_dir: str
    ) -> dict[str, Any]:
        """``{"task", "summary", "step", "eval_seconds", "file"}`` of the base model (``run_dir``
        None) or of ``run_dir``'s latest checkpoint on ``cfg``'s held-out set. The file has
        ``jaxgrpo.evaluate``'s layout (``runs.<label>.tasks.<task>``: summary and records)."""
        import jax

        from jaxgrpo.run import evaluate as cli

        path = os.path.join(out_dir, "eval_test.json")
        protocol = dataclasses.asdict(self.settings)
        step = trained_step(cfg) if run_dir else 0
        cached = read_json(path)
        if cached.get("settings") == protocol and cached.get("step") == step:
            return {**cached["study"], "file": path}
        t0 = time.perf_counter()
        model, tokenizer, reward_set, step, agent = cli.load_scored_policy(
            cfg, run_dir, self.mesh, cache=self.models
        )
        task_name, examples = cli.task_examples(cfg, None, None, self.settings)
        summary, records = cli.evaluate_examples(
            model,
            tokenizer,
            examples,
            self.settings,
            self.mesh,
            reward_set=reward_set,
            step=step,
            max_steps=cfg.steps,
            agent=agent,
        )
        result = {
            "task": task_name,
            "summary": summary,
            "strict_se": strict_standard_error(records),
            "step": step,
            "eval_seconds": time.perf_counter() - t0,
        }
        if jax.process_index() == 0:
            os.makedirs(out_dir, exist_ok=True)
            tasks = {task_name: {"summary": summary, "records": records}}
            run = {"checkpoint": run_dir, "step": step, "tasks": tasks}
            write_json(
                path, {"settings": protocol, "step": step, "study": result, "runs": {label: run}}
            )
        return {**result, "file": path}


def strict_standard_error(records: list[dict]) -> float:
    """The standard error of held-out strict accuracy over prompts: the samples of one prompt
    are not independent, so each prompt's mean is one observation."""
    per_prompt: dict[int, list[float]] = {}
    for r in records:
        per_prompt.setdefault(r["prompt"], []).append(float(r["strict"]))
    means = np.array([np.mean(v) for v in per_prompt.values()])
    return float(means.std(ddof=1) / np.sqrt(len(means))) if len(means) > 1 else 0.0


def training_signal(run_dir: str | None) -> dict[str, float]:
    """What a trained arm's steps had to learn from (its ``metrics.jsonl``): the mean fraction
    of groups with zero advantage (every episode scored alike), the mean training reward, and
    with tools the calls per episode at the first and the last step."""
    path = os.path.join(run_dir or "", "metrics.jsonl")
    if not run_dir or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "adv/frac_zero_std_groups" in r]
    if not steps:
        return {}
    out = {
        "zero_adv_groups": float(np.mean([r["adv/frac_zero_std_groups"] for r in steps])),
        "train_reward": float(np.mean([r.get("reward/mean", np.nan) for r in steps])),
    }
    calls = [r["agent/tool_calls"] for r in steps if "agent/tool_calls" in r]
    if calls:
        out["calls_first"], out["calls_last"] = float(calls[0]), float(calls[-1])
    return out


# ----------------------------------------------------------------------------------------------
# Results.

# results.md columns: (header, function of an arm's result -> cell text).
_PCT = "{:.1f}"


def _pct(key: str) -> Callable[[dict], str]:
    return lambda r: _PCT.format(100.0 * r["summary"][key])


def _mean_length(key: str) -> Callable[[dict], str]:
    def cell(r: dict) -> str:
        value = r["summary"][key]["mean"]
        return "-" if value != value else f"{value:.0f}"  # NaN: no such answers

    return cell


def _signal(key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> Callable[[dict], str]:
    def cell(result: dict) -> str:
        value = result.get("signal", {}).get(key)
        return "-" if value is None else fmt.format(scale * value)

    return cell


def _per_episode(key: str) -> Callable[[dict], str]:
    def cell(result: dict) -> str:
        value = result["summary"].get(key)
        return "-" if value is None else f"{value:.2f}"

    return cell


def columns(k: int, tools: bool = False) -> list[tuple[str, Callable[[dict], str]]]:
    """The table's columns for ``k`` samples per prompt; with ``tools`` (some arm ran episodes
    with tools) also calls, turns and failed calls per episode."""
    from jaxgrpo.grading.accuracy import FORMAT, LENIENT, STRICT

    agent = [
        ("tool calls / episode", _per_episode("agent/tool_calls")),
        ("turns", _per_episode("agent/turns")),
        ("tool errors / episode", _per_episode("agent/failed")),
    ]
    se = lambda r: "-" if r.get("strict_se") is None else f"{100 * r['strict_se']:.1f}"  # noqa: E731
    calls = [("train calls / episode, first -> last", _calls_trend)] if tools else []
    return [
        ("strict %", _pct(STRICT)),
        ("s.e.", se),
        *(agent if tools else []),
        ("zero-adv groups %", _signal("zero_adv_groups", 100.0, "{:.0f}")),
        *calls,
        ("lenient %", _pct(LENIENT)),
        ("format %", _pct(FORMAT)),
        (f"pass@{k} %", _pct(f"pass@{k}")),
        ("len correct", _mean_length("length_correct")),
        ("len incorrect", _mean_length("length_incorrect")),
        ("doom loop %", _pct("doom_loop")),
        (
            "train min",
            lambda r: "-" if r.get("train_seconds") is None else f"{r['train_seconds'] / 60:.1f}",
        ),
    ]


def _calls_trend(result: dict) -> str:
    signal = result.get("signal", {})
    if "calls_first" not in signal:
        return "-"
    return f"{signal['calls_first']:.2f} -> {signal['calls_last']:.2f}"


def results_markdown(study: Study, rows: dict[str, dict], protocol: dict) -> str:
    """``results.md``: a heading, the protocol, the table, and each arm's note."""
    k = protocol["num_samples"]
    cols = columns(k, tools=any("agent/tool_calls" in r["summary"] for r in rows.values()))
    lines = [
        f"# {study.title or study.name}",
        "",
        f"Held-out: {rows[next(iter(rows))]['summary']['num_prompts']} prompts x {k} samples, "
        f"{protocol['max_new_tokens']} new tokens, temperature {protocol['temperature']}, "
        f"top-p {protocol['top_p']}. Lengths in tokens.",
        "",
        "| arm | " + " | ".join(h for h, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for label, result in rows.items():
        lines.append(f"| {label} | " + " | ".join(fn(result) for _, fn in cols) + " |")
    notes = [(a.label, a.note) for a in study.arms if a.note and a.label in rows]
    if notes:
        lines += [""] + [f"- **{label}**: {note}" for label, note in notes]
    return "\n".join(lines) + "\n"


def write_plots(run_dirs: dict[str, str], out_dir: str) -> list[str]:
    """Every arm overlaid: held-out accuracy over training, the dashboard, one PNG a quantity."""
    from jaxgrpo.grading.accuracy import STRICT
    from jaxgrpo.run import plot

    runs = {label: plot.read_metrics(d) for label, d in run_dirs.items()}
    os.makedirs(out_dir, exist_ok=True)
    held_out = plot.plot_metric(
        runs,
        f"eval/{STRICT}",
        os.path.join(out_dir, "heldout_accuracy.png"),
        "held-out strict accuracy (greedy)",
    )
    dashboard = plot.plot_dashboard(runs, os.path.join(out_dir, "dashboard.png"))
    return [held_out, dashboard, *plot.plot_quantities(runs, out_dir)]
