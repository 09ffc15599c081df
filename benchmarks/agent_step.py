"""What a training step with a tool costs against the same step without it (a benchmark, not a
test): seconds per step and per phase, model and tool tokens per episode, calls per episode,
the programs compiled at each step, and the held-out evaluations' seconds.

Runs ``python -m jaxgrpo.train`` twice, one after the other, on the same config and steps: once
as it is, once with the calculator (``agent.tools=('calc',)``, the tag format, at most 4 turns,
the worked example calling it). The compilation cache is off, so each run compiles what it
needs; JAX logs every compilation, which is counted against the step that was running.

    python benchmarks/agent_step.py [--config arithmetic.py] [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

TOOL = [
    "--config.agent.tools=('calc',)",
    "--config.agent.format=tag",
    "--config.agent.max_turns=4",
    "--config.task.kwargs.worked_calc=True",
]


def train(config: str, steps: int, extra: list[str], run_dir: str) -> dict:
    """One training run: wall seconds, its metrics rows, and compilations per step."""
    cmd = [
        sys.executable, "-m", "jaxgrpo.train", "--config", config, f"--config.steps={steps}",
        "--config.eval.every=0", "--config.checkpoint.every=0", f"--config.run_dir={run_dir}",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "JAXGRPO_CACHE_DIR": "off", "JAX_LOG_COMPILES": "1"}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    compiles: collections.Counter[int] = collections.Counter()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )

    def rows_written() -> int:
        if not os.path.exists(metrics):
            return 0
        with open(metrics, encoding="utf-8") as f:
            return sum(1 for line in f if '"time/sampling"' in line)

    def read() -> None:
        for line in proc.stderr:
            if "Finished XLA compilation" in line:
                compiles[rows_written() + 1] += 1

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait()
    reader.join()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    with open(metrics, encoding="utf-8") as f:
        logged = [json.loads(line) for line in f]
    rows = [r for r in logged if "time/sampling" in r]
    evals = {int(r["step"]): r["time/eval"] for r in logged if "time/eval" in r}
    return {"wall": wall, "rows": rows, "compiles": compiles, "evals": evals}


def table(label: str, run: dict) -> list[str]:
    evals = ", ".join(f"step {k} {v:.1f} s" for k, v in sorted(run["evals"].items()))
    lines = [f"\n{label}: whole run {run['wall']:.0f} s; held-out evaluations: {evals}", ""]
    lines.append(
        "| step | calls / episode | model tokens | tool tokens | sampling s | update s | step s "
        "| compiled |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(run["rows"], 1):
        step = sum(v for k, v in r.items() if k in PHASES)
        calls, model = r.get("agent/tool_calls", 0), r.get("completion/length_mean", 0)
        lines.append(
            f"| {i} | {calls:.2f} | {model:.1f} "
            f"| {r.get('completion/tool_length_mean', 0):.1f} | {r['time/sampling']:.1f} "
            f"| {r['time/update']:.1f} | {step:.1f} | {run['compiles'].get(i, 0)} |"
        )
    return lines


PHASES = ("time/sampling", "time/rewards", "time/reference", "time/update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="arithmetic.py")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="agent_step_")
    runs = {}
    for label, extra in (("without the tool", []), ("with the calculator", TOOL)):
        runs[label] = train(
            args.config, args.steps, extra, os.path.join(out, "tool" if extra else "plain")
        )
        print("\n".join(table(label, runs[label])), flush=True)
    plain, tool = runs["without the tool"], runs["with the calculator"]

    def warm(run):
        """Mean seconds of the steps after the first that compiled nothing."""
        steps = [
            sum(r[k] for k in PHASES if k in r)
            for i, r in enumerate(run["rows"][1:], 2)
            if not run["compiles"].get(i)
        ]
        return sum(steps) / max(len(steps), 1)

    steps = len(tool["rows"])  # compilations past the last step are the closing evaluation's
    late = sum(n for step, n in tool["compiles"].items() if 1 < step <= steps)
    print(
        f"\nwarm step with the tool / without: {warm(tool):.1f} / {warm(plain):.1f} s = "
        f"{warm(tool) / warm(plain):.2f}x; whole run {tool['wall']:.0f} / {plain['wall']:.0f} s "
        f"= {tool['wall'] / plain['wall']:.2f}x; programs compiled after step 1 with the tool: "
        f"{late}"
    )


if __name__ == "__main__":
    main()
