"""Where a GRPO step's scoring passes and update spend their time and memory, on one rollout.

`grpo_step.py` measures whole steps; at 512 new tokens each one samples for most of a minute
before the passes this script isolates. It samples one rollout of `grpo_step.py`'s workload
(or loads one saved with `--save`), then runs the learner's reference pass (`prepare`) and
update (`optimize`) on it `--repeats` times after a compiling run, and prints: the
completions' lengths, the packed layout (columns scored against real tokens), seconds per
pass, the compiled update's memory (XLA's `memory_analysis`) and the peak RSS. Same rollout,
so two trees or two settings compare exactly. `--ops N` then traces one more reference pass and
update under `jax.profiler` and prints each program's N most expensive XLA ops (summed over
calls, with the JAX operation each comes from).

    python benchmarks/update_profile.py --task gsm8k --new-tokens 512 --save /tmp/r512.pkl
    python benchmarks/update_profile.py --task gsm8k --new-tokens 512 --load /tmp/r512.pkl \\
        --variant full

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpo_step  # noqa: E402  (this folder's workload definitions)

GB = 1e9


def layout(learner, rollout) -> str:
    """The packed rows' width and how much of them real tokens fill."""
    inputs, packing, _, t = learner.batches.batch_inputs(rollout)
    lengths = rollout.mask.sum(axis=1)
    totals = lengths.reshape(-1, learner.rl.group_size).sum(axis=1)
    if packing is None:
        cols = inputs[2].shape[0] * t
        shape = f"unpacked rows {inputs[2].shape[0]} x {t}"
    else:
        rows, width = packing.src_BL.shape
        cols, shape = rows * width, f"packed rows {rows} x {width}"
    return (
        f"completions: mean {lengths.mean():.0f}, max {lengths.max()} tokens; group totals "
        f"{', '.join(str(int(x)) for x in totals)}; {shape}: {int(lengths.sum())} real tokens "
        f"in {cols} columns ({lengths.sum() / cols:.0%})"
    )


def _compile_update(learner, state, batch):
    """The learner's update program for `batch`, compiled, and its micro-batch count."""
    import numpy as np

    b, u = learner.rl.prompts_per_step, learner.programs.micro_batches(batch)
    idx = learner.programs.replicate(np.arange(b, dtype=np.int32).reshape(u, b // u), np.int32)
    return learner.programs.update.lower(state, learner.programs.frozen, batch, idx).compile(), u


def compiled_update(learner, state, batch) -> str:
    """The compiled update's temporaries, arguments and outputs, as XLA reports them."""
    compiled, u = _compile_update(learner, state, batch)
    mem = compiled.memory_analysis()
    return (
        f"compiled update ({u} micro-batch{'es' if u > 1 else ''}): temporaries "
        f"{mem.temp_size_in_bytes / GB:.2f} GB, arguments {mem.argument_size_in_bytes / GB:.2f} "
        f"GB, outputs {mem.output_size_in_bytes / GB:.2f} GB"
    )


def top_ops(run, compiled_text: str, name: str, n: int) -> None:
    """Runs `run()` under `jax.profiler` and prints the `n` XLA ops that took the most time
    (summed over their calls), each with its output shape and JAX source op from
    `compiled_text` (the HLO of the program `run` calls)."""
    import collections
    import glob
    import re

    import jax

    hlo = {}
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+)", line)
        if m:
            source = re.search(r'op_name="([^"]*)"', line)
            hlo.setdefault(m.group(1), (m.group(2), source.group(1) if source else ""))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        run()
    totals: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    totals[str(stats["hlo_op"])] += event.duration_ns
                    calls[str(stats["hlo_op"])] += 1
    print(f"{name}: {sum(totals.values()) / 1e9:.2f} s of op time; the top {n}:")
    for op, ns in totals.most_common(n):
        shape, source = hlo.get(op, ("?", ""))
        print(f"  {ns / 1e9:7.2f} s  x{calls[op]:<5d} {op[:26]:26} {shape[:26]:26} {source[-90:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gsm8k", choices=["format_copy", "gsm8k"])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--model", default="smollm2", choices=sorted(grpo_step.MODELS))
    parser.add_argument("--variant", default="lora", choices=["lora", "full"])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the compiling one")
    parser.add_argument("--save", default="", help="sample a rollout and keep it here")
    parser.add_argument("--load", default="", help="a rollout saved with --save")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides key=value")
    parser.add_argument("--ops", type=int, default=0, help="then trace and print the top N ops")
    args = parser.parse_args()

    from jaxgrpo.core.host import keep_freed_memory, use_cpu_xla_flags
    from jaxgrpo.rl import step_metrics
    from jaxgrpo.run.build import build_parts
    from jaxgrpo.settings.loading import config_override

    use_cpu_xla_flags()
    keep_freed_memory()
    name = f"{args.model.replace(':', '_').replace('.', '')}_hf"
    hf_dir = grpo_step.export_model(args.model, os.path.join(tempfile.gettempdir(), name))
    w = grpo_step.Workload(args.model, args.task, args.new_tokens, steps=1, hf_dir=hf_dir)
    extra = dict(config_override(s) for s in args.set)
    cfg = grpo_step.jaxgrpo_config(w, args.variant == "lora", extra)
    learner = build_parts(cfg).learner
    state = learner.init_state()
    if args.load:
        with open(args.load, "rb") as f:
            rollout = pickle.load(f)
    else:
        examples = grpo_step.examples(w.task, w.prompts)
        key = learner.programs.advance(state.step, state.rng)[2]
        t0 = time.perf_counter()
        rollout, _ = learner.collect(state.params, examples, key, 0, None, step_metrics.Timer())
        print(f"sampled in {time.perf_counter() - t0:.1f} s (with compilation)", flush=True)
        if args.save:
            with open(args.save, "wb") as f:
                pickle.dump(rollout, f)
    print(layout(learner, rollout), flush=True)
    times: dict[str, list[float]] = {"reference": [], "update": []}
    for i in range(args.repeats + 1):
        timer = step_metrics.Timer()
        batch, _ = learner.prepare(state, rollout, timer)
        if i == 0:
            print(compiled_update(learner, state, batch), flush=True)
        key = learner.programs.advance(state.step, state.rng)[3]
        t0 = time.perf_counter()
        state, metrics = learner.optimize(state, batch, key)
        float(metrics["loss"])
        update = time.perf_counter() - t0
        print(
            f"run {i}{' (compiles)' if i == 0 else ''}: "
            f"reference {timer.seconds['reference']:.2f} s, update {update:.2f} s",
            flush=True,
        )
        if i:
            times["reference"].append(timer.seconds["reference"])
            times["update"].append(update)
    median = {k: statistics.median(v) for k, v in times.items() if v}
    print(
        f"median of {args.repeats}: reference {median.get('reference', 0):.2f} s, "
        f"update {median.get('update', 0):.2f} s; peak RSS {grpo_step.peak_rss_mb() / 1024:.2f} GiB"
    )
    if args.ops:
        import jax

        ref = learner.programs.reference(state)
        inputs, packing, shared, _ = learner.batches.batch_inputs(rollout)
        scoring = (ref, learner.programs.frozen, *inputs, packing, shared)
        text = learner.programs.logprobs.lower(*scoring).compile().as_text()
        top_ops(
            lambda: jax.block_until_ready(learner.programs.logprobs(*scoring)),
            text,
            "reference",
            args.ops,
        )
        text = _compile_update(learner, state, batch)[0].as_text()
        key = learner.programs.advance(state.step, state.rng)[3]
        top_ops(
            lambda: float(learner.optimize(state, batch, key)[1]["loss"]), text, "update", args.ops
        )


if __name__ == "__main__":
    main()
