"""Asynchronous rollouts on this CPU (a benchmark, not a test): where host work is a share of a
step, what a lag of 1 and 2 gains over the synchronous loop, and at what held-out accuracy.

On a CPU the devices are the host's cores, so the sampler and the learner share them and only
host-bound work can overlap. Two workloads:

- ``format_copy``: the quickstart (``format_copy.py``: SmolLM2-135M + LoRA, 4 prompts x 8
  samples, 20 steps) plus a reward function that sleeps ``--sleep`` seconds per batch and
  scores 0 (a stand-in for a remote judge or a sandbox: host time, no CPU), so every arm
  learns from the same reward.
- ``calculator``: ``tool_use_mini``'s tool arm (``calculator.py``: episodes with the ``calc``
  tool), whose host work is the tool calls and the episodes' bookkeeping between turns.

The arms (``rl.max_staleness`` 0, 1, 2) run one after the other with the compilation cache on.
Per arm: seconds per warm step (steps 2 on), steps per hour, the whole run's wall time, the
final held-out strict accuracy (greedy over the config's held-out set) with its binomial
standard error, the mean lag, how long the learner waited for batches, and the lag
correction's weights.

    python benchmarks/async_rollouts.py [--workload format_copy] [--sleep 2] [--steps 20]
        [--lags 0,1,2] [--set --config.rl.lag_correction=mask ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

SLEEP_ENV = "ASYNC_BENCH_SLEEP_S"
WORKLOADS = {
    "format_copy": [
        "--config",
        "format_copy.py",
        "--config.rewards.functions=(('format_copy', 1.0, {'similarity': 0.5}), "
        "('async_rollouts.sleeping_judge', 1.0))",
    ],
    "calculator": ["--config", "calculator.py"],
}


def sleeping_judge(prompts, completions, **_):
    """Sleeps ``$ASYNC_BENCH_SLEEP_S`` seconds per batch and scores every completion 0."""
    time.sleep(float(os.environ.get(SLEEP_ENV, "2")))
    return [0.0] * len(completions)


def run_arm(workload: str, lag: int, steps: int, sleep: float, run_dir: str, extra=()) -> dict:
    """Trains one arm (``extra``: more ``--config.*`` overrides); its step rows, final
    held-out metrics and wall time."""
    cmd = [
        sys.executable, "-m", "jaxgrpo.train", *WORKLOADS[workload],
        f"--config.steps={steps}", f"--config.rl.max_staleness={lag}",
        "--config.eval.every=0", "--config.checkpoint.every=0",
        "--config.logging.progress=False", f"--config.run_dir={run_dir}", *extra,
    ]  # fmt: skip
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, SLEEP_ENV: str(sleep), "PYTHONPATH": path}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    steps_rows = [r for r in rows if "time/step" in r]
    return {"rows": steps_rows, "eval": rows[-1], "wall": wall}


def mean(rows: list[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def summary(lag: int, arm: dict) -> dict:
    warm = arm["rows"][1:]
    ev = arm["eval"]
    acc, n = float(ev.get("eval/strict_accuracy", float("nan"))), ev.get("eval/num_examples", 0)
    se = math.sqrt(acc * (1 - acc) / n) if n else float("nan")
    return {
        "lag": lag,
        "s_per_step": mean(warm, "time/step"),
        "wall_s": arm["wall"],
        "strict": acc,
        "strict_se": se,
        "n_eval": n,
        "lag_mean": mean(warm, "async/lag_mean") if lag else 0.0,
        "learner_wait_s": mean(warm, "async/learner_wait_s") if lag else 0.0,
        "rewards_s": mean(warm, "time/rewards"),
        "sampling_s": mean(warm, "time/sampling"),
        "update_s": mean(warm, "time/update") + mean(warm, "time/reference"),
        "is_weight_max": max((r.get("lag/is_weight_max", 1.0) for r in warm), default=1.0),
        "is_clipped_frac": mean(warm, "lag/is_clipped_frac") if lag else 0.0,
    }


def table(rows: list[dict]) -> str:
    base = rows[0]["s_per_step"]
    lines = [
        "| lag | s/step (warm) | steps/hour | vs lag 0 | whole run | held-out strict (s.e.) "
        "| lag mean | learner wait s | IS weight max | clipped frac |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lag']} | {r['s_per_step']:.2f} | {3600 / r['s_per_step']:.0f} "
            f"| {base / r['s_per_step']:.2f}x | {r['wall_s'] / 60:.1f} min "
            f"| {100 * r['strict']:.1f}% ({100 * r['strict_se']:.1f}) of {r['n_eval']} "
            f"| {r['lag_mean']:.2f} | {r['learner_wait_s']:.2f} | {r['is_weight_max']:.3f} "
            f"| {r['is_clipped_frac']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="format_copy")
    parser.add_argument("--sleep", type=float, default=2.0, help="the judge's seconds per batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lags", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], help="--config.KEY=VALUE, again")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lag in (int(x) for x in args.lags.split(",")):
            run_dir = os.path.join(tmp, str(lag))
            arm = run_arm(args.workload, lag, args.steps, args.sleep, run_dir, args.set)
            rows.append(summary(lag, arm))
            r = rows[-1]
            print(
                f"lag {lag}: {r['s_per_step']:.2f} s/step (sampling {r['sampling_s']:.2f}, "
                f"rewards {r['rewards_s']:.2f}, reference + update {r['update_s']:.2f}), "
                f"strict {100 * r['strict']:.1f}%",
                flush=True,
            )
    sleep = f", judge sleeping {args.sleep:g} s per batch" if args.workload == "format_copy" else ""
    print(f"\n{args.workload}, {args.steps} steps{sleep} {' '.join(args.set)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
