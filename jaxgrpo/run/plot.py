"""``python -m jaxgrpo.plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG curves from metrics.jsonl.

Two kinds of picture, runs overlaid so they compare at a glance:

- ``dashboard.png``: one figure with every view of a GRPO run (``DASHBOARD``): reward per reward
  function, train and held-out accuracy, KL, entropy, completion length of correct against
  incorrect answers (the Dr. GRPO view), truncation, clip fraction and sampling temperature. One
  colour per run across all panels; a panel no run has data for says "no data", so the grid
  looks the same for every run.
- one PNG per quantity (``PANELS``), larger; quantities no run logged are skipped.

Metric keys are the learner's (``jaxgrpo.rl.step_metrics``); accuracy is ``strict_accuracy``,
``lenient_accuracy`` and ``format_rate`` (``jaxgrpo.grading.accuracy``); held-out figures are the
``eval/`` keys the trainer logs before, during and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxgrpo.grading.accuracy import FORMAT, LENIENT, STRICT

# Figure name -> candidate metric keys, first match wins; dashed lines for the "eval/" twin.
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean", "reward"),
    "accuracy": (STRICT, f"eval/{STRICT}"),
    "kl": ("kl/mean", "kl_mean", "kl"),
    "entropy": ("entropy/mean", "entropy_mean", "entropy"),
    "length": ("completion/length_mean", "completion_length", "length"),
}


@dataclass(frozen=True)
class Curve:
    """One line per run in a dashboard panel.

    Attributes:
      keys: candidate metric keys, the first one a run logged is drawn.
      label: the line's name in the panel's legend ("" = no legend entry).
      style: matplotlib format string (markers and line style; the colour is the run's).
    """

    keys: tuple[str, ...]
    label: str = ""
    style: str = "-"


# Dashboard panel title -> its curves; "reward per function" is filled from the logged keys.
DASHBOARD: dict[str, tuple[Curve, ...]] = {
    "reward per function": (),
    "train accuracy": (
        Curve((STRICT,), "strict", "-"),
        Curve((LENIENT,), "lenient", ":"),
        Curve((FORMAT,), "format", "--"),
    ),
    "held-out accuracy": (
        Curve((f"eval/{STRICT}",), "strict", "o-"),
        Curve((f"eval/{LENIENT}",), "lenient", "s:"),
        Curve((f"eval/{FORMAT}",), "format", "^--"),
    ),
    "KL to reference": (Curve(("kl/mean",)),),
    "entropy": (Curve(("entropy",)),),
    "completion length": (
        Curve(("completion/length_correct",), "correct", "-"),
        Curve(("completion/length_incorrect",), "incorrect", "--"),
    ),
    "truncated fraction": (Curve(("completion/truncated_frac",)),),
    "clip fraction": (Curve(("clip_frac",)),),
    "temperature": (Curve(("temperature", "sampling/temperature")),),
}
_FN_STYLES = ("-", "--", ":", "-.")
_UNIT_PANELS = ("train accuracy", "held-out accuracy", "truncated fraction")


def read_metrics(run_dir: str) -> dict[int, dict]:
    """Step -> merged metrics of ``run_dir/metrics.jsonl`` (later lines win on a repeated step)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a jaxgrpo run directory?")
    rows: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(int(row["step"]), {}).update(row)
    return dict(sorted(rows.items()))


def read_runs(run_dirs: Sequence[str]) -> dict[str, dict[int, dict]]:
    """Run label (the directory's name, made unique) -> its metrics, in the order given."""
    runs: dict[str, dict[int, dict]] = {}
    for run_dir in run_dirs:
        label = base = os.path.basename(os.path.normpath(run_dir)) or run_dir
        i = 2
        while label in runs:
            label, i = f"{base}-{i}", i + 1
        runs[label] = read_metrics(run_dir)
    return runs


def series(rows: dict[int, dict], candidates: Sequence[str]) -> tuple[str, np.ndarray, np.ndarray]:
    """(key, steps, values) for the first candidate key with at least one numeric value."""
    for key in candidates:
        pairs = [
            (step, row[key])
            for step, row in rows.items()
            if isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool)
        ]
        if pairs:
            steps, values = zip(*pairs, strict=True)
            return key, np.asarray(steps), np.asarray(values, dtype=np.float64)
    return "", np.zeros(0), np.zeros(0)


def reward_functions(runs: dict[str, dict[int, dict]]) -> list[str]:
    """Names of the reward functions any run logged (``reward/<fn>/mean``), first seen first."""
    names: dict[str, None] = {}
    for rows in runs.values():
        for row in rows.values():
            for key in row:
                parts = key.split("/")
                if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
                    names[parts[1]] = None
    return list(names)


# Drawn when a run used tools (it logged ``agent/*``): per episode, means over the step.
TOOL_USE = (
    Curve(("agent/tool_calls",), "calls", "-"),
    Curve(("agent/turns",), "turns", "--"),
    Curve(("agent/failed",), "failed calls", ":"),
)


def dashboard_panels(runs: dict[str, dict[int, dict]]) -> dict[str, tuple[Curve, ...]]:
    """``DASHBOARD`` with the reward panel's curves (one per logged reward function), and a
    "tool use" panel for runs with tools."""
    functions = reward_functions(runs)
    rewards = tuple(
        Curve((f"reward/{fn}/mean",), fn, _FN_STYLES[i % len(_FN_STYLES)])
        for i, fn in enumerate(functions)
    )
    panels = {**DASHBOARD, "reward per function": rewards or (Curve(("reward/mean",)),)}
    if any("agent/tool_calls" in row for rows in runs.values() for row in rows.values()):
        panels["tool use"] = TOOL_USE
    return panels


def _pyplot():
    # matplotlib is imported on first use: it is slow to import and only plotting needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_colours(plt, n: int) -> list:
    """One colour per run, shared by every panel and figure."""
    cycle = plt.get_cmap("tab10").colors
    return [cycle[i % len(cycle)] for i in range(n)]


def _draw_panel(ax, title: str, curves: Sequence[Curve], runs: dict, colours: list) -> bool:
    """Draws ``curves`` of every run on ``ax``; returns False (and says so) if none had data."""
    ax.set_title(title)
    drawn: dict[Curve, None] = {}
    # Earlier runs are drawn wider, so a run that a later one covers still shows around it.
    widths = np.linspace(1.5 + 0.75 * (len(runs) - 1), 1.5, len(runs)) if runs else []
    for rows, colour, width in zip(runs.values(), colours, widths, strict=True):
        for curve in curves:
            _, steps, values = series(rows, curve.keys)
            if steps.size:
                style = _style(curve.style, steps.size)
                ax.plot(steps, values, style, color=colour, lw=width, ms=width + 3)
                drawn[curve] = None
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, c="0.5")
        ax.set_xticks([])
        ax.set_yticks([])
        return False
    # Line styles tell the curves of one panel apart; the run colours are in the figure legend.
    for curve in (c for c in drawn if c.label):
        ax.plot([], [], curve.style, color="0.35", label=curve.label)
    if any(c.label for c in drawn):
        ax.legend(fontsize="small", loc="best")
    if title in _UNIT_PANELS:
        ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("step")
    ax.locator_params(axis="x", integer=True)  # steps are whole numbers
    ax.grid(alpha=0.3)
    return True


def _style(style: str, points: int) -> str:
    """``style``, with point markers added for a short series, so a single point still shows."""
    if points > 30 or any(c in "o.sx^v*+D" for c in style):
        return style
    return "." + style


def dashboard_figure(runs: dict[str, dict[int, dict]], columns: int = 3):
    """The dashboard of ``runs`` (label -> metrics) as a matplotlib figure, one axes per panel
    of ``dashboard_panels`` (titled with the panel's name) and a legend naming the runs."""
    plt = _pyplot()
    panels = dashboard_panels(runs)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3.4 * rows + 0.6), layout="constrained", squeeze=False
    )
    colours = run_colours(plt, len(runs))
    for ax, (title, curves) in zip(axes.flat, panels.items(), strict=False):
        _draw_panel(ax, title, curves, runs, colours)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=c, lw=2.5) for c in colours]
    fig.legend(handles, list(runs), loc="outside upper center", ncol=min(len(runs), 6))
    return fig


def plot_dashboard(runs: dict[str, dict[int, dict]], path: str) -> str:
    """Writes ``dashboard_figure(runs)`` to ``path`` (PNG); returns ``path``."""
    fig = dashboard_figure(runs)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_quantities(runs: dict[str, dict[int, dict]], out_dir: str) -> list[str]:
    """Writes one PNG per ``PANELS`` quantity some run has data for; returns their paths."""
    plt = _pyplot()
    colours = run_colours(plt, len(runs))
    written = []
    for panel, candidates in PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        plotted = False
        for (name, rows), colour in zip(runs.items(), colours, strict=True):
            key, steps, values = series(rows, candidates)
            if steps.size:
                marker = "." if steps.size < 50 else None
                ax.plot(steps, values, marker=marker, color=colour, label=name)
                ax.set_ylabel(key)
                plotted = True
            eval_key, e_steps, e_values = series(rows, ("eval/" + panel,))
            if e_steps.size and eval_key != key:
                ax.plot(e_steps, e_values, "--o", color=colour, label=f"{name} ({eval_key})")
                plotted = True
        if plotted:
            ax.set_xlabel("step")
            ax.set_title(panel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            path = os.path.join(out_dir, f"{panel}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written


def plot_metric(runs: dict[str, dict[int, dict]], key: str, path: str, title: str) -> str:
    """Writes one metric of every run overlaid (points joined by lines) to ``path``; a run
    without the metric is left out of the picture. Returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, rows), colour in zip(runs.items(), run_colours(plt, len(runs)), strict=True):
        _, steps, values = series(rows, (key,))
        if steps.size:
            ax.plot(steps, values, "-o", color=colour, label=name, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_runs(run_dirs: Sequence[str], out_dir: str) -> list[str]:
    """Writes ``dashboard.png`` and the per-quantity PNGs of ``run_dirs``; returns their paths
    (the dashboard first)."""
    runs = read_runs(run_dirs)
    os.makedirs(out_dir, exist_ok=True)
    dashboard = plot_dashboard(runs, os.path.join(out_dir, "dashboard.png"))
    return [dashboard, *plot_quantities(runs, out_dir)]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: draw the plots, print their paths."""
    parser = argparse.ArgumentParser(prog="python -m jaxgrpo.plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dirs[0], "plots")
    try:
        paths = plot_runs(args.run_dirs, out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
