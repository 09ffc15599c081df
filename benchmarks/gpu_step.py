"""Measured seconds beside `python -m jaxgrpo.compile`'s roofline estimate, on this machine.

The accelerator check: `gsm8k_hard`'s step (16 prompts x 8 samples, 512 new tokens,
bfloat16, LoRA r16; the bundled GSM8K fixture prompts) with random weights of `--model`, on the
local devices of `--preset`. It first compiles the step's programs through
`jaxgrpo.planning.compile.compile_config` (memory, FLOPs and the estimate per program, as the
TPU grid reports them), then trains `--steps` measured steps after a compiling one and prints,
per phase, the estimate beside the median measured seconds, the sampler's tokens per second, and the
step's MFU from the measured time. Random weights rarely stop early, so most rows decode all
`max_new_tokens`, as the estimate assumes.

    python benchmarks/gpu_step.py --preset h200-1 [--model Qwen2.5-1.5B] [--steps 3]
    python benchmarks/gpu_step.py --preset cpu-1 --model SmolLM2-135M --prompts 2 --group 2 \\
        --new-tokens 8 --steps 1     # a smoke run of the script itself on a CPU

Nothing in jaxgrpo depends on this script or on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time

PHASES = {"sampling": ("sample/prefill", "sample/decode"), "update": ("score", "update")}


def overrides(args) -> dict:
    return {
        "model.source": f"random:{args.model}",
        "model.lora_rank": args.lora_rank,
        "task.kwargs.source": "fixture",
        "rl.prompts_per_step": args.prompts,
        "rl.group_size": args.group,
        "sampling.max_new_tokens": args.new_tokens,
        "steps": args.steps + 1,
        "run_dir": tempfile.mkdtemp(),
    }


def estimate(args) -> dict:
    """The compile report's per-phase estimate (seconds, summed over calls) and step figures."""
    from jaxgrpo.planning.compile import TABLE_ONLY, compile_config

    rep = compile_config(args.config, args.preset, overrides(args), args.prompt_len, TABLE_ONLY)
    phases = {
        phase: sum(
            p["estimate_s"] * p["calls"]
            for p in rep["programs"]
            if p["program"].startswith(prefixes)
        )
        for phase, prefixes in PHASES.items()
    }
    return {"phases": phases, "step": rep["step"], "facts": rep["facts"]}


def measure(args) -> dict:
    """Median seconds per phase over the measured steps, and sampled tokens per second."""
    from jaxgrpo.data import get_task
    from jaxgrpo.run.build import build_parts
    from jaxgrpo.settings.loading import load_config

    cfg = load_config(args.config, overrides(args))
    learner = build_parts(cfg).learner
    state = learner.init_state()
    examples = itertools.cycle(get_task(cfg.task.name, source="fixture").train_examples(0))
    rows = []
    for i in range(args.steps + 1):
        batch = [next(examples) for _ in range(args.prompts)]
        t0 = time.perf_counter()
        state, metrics, _ = learner.step(state, batch)
        seconds = time.perf_counter() - t0
        tokens = metrics["completion/length_mean"] * args.prompts * args.group
        print(f"  step {i}: {seconds:.2f} s, {tokens:.0f} tokens sampled", flush=True)
        if i:  # step 0 compiles
            rows.append(
                dict(
                    step=seconds,
                    sampling=metrics["time/sampling"],
                    update=metrics["time/update"],
                    tokens_per_s=tokens / metrics["time/sampling"],
                )
            )
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h200-1", help="h200-1, h100-8, cpu-1, ...")
    parser.add_argument("--config", default="gsm8k_hard")
    parser.add_argument("--model", default="Qwen2.5-1.5B")
    parser.add_argument("--lora_rank", type=int, default=16, help="0 = full fine-tuning")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", dest="new_tokens", type=int, default=512)
    parser.add_argument("--prompt_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the first")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.preset.startswith("cpu-"):
        import os

        from jaxgrpo.core.host import force_host_devices

        force_host_devices(int(args.preset[4:]))
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    est = estimate(args)
    got = measure(args)
    step_flops, devices = est["step"]["flops"], est["facts"]["devices"]
    from jaxgrpo.planning.compile import _preset

    peak = _preset(args.preset).specs.bf16_flops * devices
    tuning = f"LoRA r{args.lora_rank}" if args.lora_rank else "full"
    shape = f"{args.prompts} x {args.group} samples, {args.new_tokens} new tokens"
    print(f"\n{args.model} ({tuning}) on {args.preset}: {shape}")
    print("| phase | estimate s | measured s | measured / estimate |")
    print("|---|---:|---:|---:|")
    for phase in ("sampling", "update"):
        e, m = est["phases"][phase], got[phase]
        print(f"| {phase} | {e:.3f} | {m:.3f} | {m / e:.2f} |")
    e, m = est["step"]["estimate_s"], got["step"]
    print(f"| step | {e:.3f} | {m:.3f} | {m / e:.2f} |")
    print(f"\nsampler: {got['tokens_per_s']:.0f} tokens/s measured")
    print(
        f"MFU: {est['step']['mfu_estimate']:.1%} estimated, {step_flops / (m * peak):.1%} measured"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"estimate": est, "measured": got}, f, indent=1, default=float)


if __name__ == "__main__":
    main()
