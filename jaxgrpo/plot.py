"""``python -m jaxgrpo.plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG curves from metrics.jsonl.

One figure per quantity (reward, accuracy, KL, entropy, completion length), one line per run, so
runs compare at a glance. A quantity is the first metric key present among its candidates (the
learner's names, with fallbacks); quantities no run logged are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import numpy as np

# Figure name -> candidate metric keys, first match wins; dashed lines for the "eval/" twin.
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean", "reward"),
    "accuracy": ("accuracy", "reward/accuracy", "eval/accuracy"),
    "kl": ("kl/mean", "kl_mean", "kl"),
    "entropy": ("entropy/mean", "entropy_mean", "entropy"),
    "length": ("completion/length_mean", "completion_length", "length"),
}


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


def plot_runs(run_dirs: Sequence[str], out_dir: str) -> list[str]:
    """Writes one PNG per panel that some run has data for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d) for d in run_dirs}
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for panel, candidates in PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        plotted = False
        for name, rows in runs.items():
            key, steps, values = series(rows, candidates)
            if steps.size:
                ax.plot(steps, values, marker="." if steps.size < 50 else None, label=name)
                ax.set_ylabel(key)
                plotted = True
            eval_key, e_steps, e_values = series(rows, ("eval/" + panel,))
            if e_steps.size and eval_key != key:
                ax.plot(e_steps, e_values, "--o", label=f"{name} ({eval_key})")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxgrpo.plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dirs[0], "plots")
    for path in plot_runs(args.run_dirs, out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
