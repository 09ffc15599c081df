"""What a second model in the loop costs per step on the quickstart's workload (a benchmark, not
a test): ``format_copy.py`` (SmolLM2-135M + LoRA, 4 prompts x 8 samples, 32 new tokens) trained
a few steps as it is, with a teacher's distillation term, and with a reward model beside the
format reward; per arm the warm steps' mean seconds and the second model's own phase
(``time/teacher``, or ``time/reward_model`` inside ``time/rewards``).

The teacher is a run directory (the quickstart's ``runs/format_copy`` by default: train it first
with ``python -m jaxgrpo.train --config format_copy.py``); the reward model is a one-label
classifier of SmolLM2-135M's shape with random weights (``random:SmolLM2-135M``: the cost does
not depend on the weights, and no classifier checkpoint of that size ships offline). The runs
go one after the other with the compilation cache on, so a warm step compiles nothing.

    python benchmarks/second_model_cost.py [--steps 5] [--teacher runs/format_copy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ARMS = {
    "policy alone": [],
    "teacher (distillation term)": [
        "--config.teacher.source={teacher}",
        "--config.teacher.distill_coef=1.0",
    ],
    "reward model": [
        "--config.rewards.functions="
        "(('format_copy', 1.0, {'similarity': 0.5}), ('random:SmolLM2-135M', 0.1))"
    ],
}
PHASES = ("sampling", "rewards", "reference", "teacher", "update")


def run_arm(extra: list[str], steps: int, run_dir: str) -> list[dict]:
    """Trains ``steps`` steps of format_copy.py with ``extra`` overrides; its step rows."""
    cmd = [
        sys.executable, "-m", "jaxgrpo.train", "--config", "format_copy.py",
        f"--config.steps={steps}", "--config.eval.every=0", "--config.task.num_eval=4",
        "--config.checkpoint.every=0", "--config.logging.progress=False",
        f"--config.run_dir={run_dir}", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "time/sampling" in r]


def mean(rows: list[dict], key: str) -> float:
    values = [float(r.get(key) or 0.0) for r in rows]
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per arm (step 1 compiles)")
    parser.add_argument("--teacher", default="runs/format_copy", help="the teacher's source")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (arm, extra) in enumerate(ARMS.items()):
            extra = [x.replace("{teacher}", os.path.abspath(args.teacher)) for x in extra]
            warm = run_arm(extra, args.steps, os.path.join(tmp, str(i)))[1:]
            results[arm] = {p: mean(warm, f"time/{p}") for p in PHASES}
            results[arm]["step"] = mean(warm, "time/step")
            results[arm]["reward_model"] = mean(warm, "time/reward_model")
    base = results["policy alone"]["step"]
    print(f"warm steps 2-{args.steps} of format_copy.py, mean seconds\n")
    print("| arm | s/step | x policy alone | sampling | rewards | teacher | update "
          "| of which the second model |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm, r in results.items():
        own = r["teacher"] or r["reward_model"]
        print(
            f"| {arm} | {r['step']:.2f} | {r['step'] / base:.2f} | {r['sampling']:.2f} | "
            f"{r['rewards']:.2f} | {r['teacher']:.2f} | {r['update']:.2f} | "
            f"{own:.2f} ({100 * own / r['step']:.0f}%) |"
        )


if __name__ == "__main__":
    main()
