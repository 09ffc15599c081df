"""`python -m jaxgrpo.memory`'s estimate beside the compiler's figures, cell by cell.

Reads the JSON of `python -m jaxgrpo.compile --config gsm8k_hard --table --json OUT` and, for
each model x tuning x slice, prints the estimator's sampling phase (parameters + KV cache +
the sampler's weights) against the compiled decode program's total, and its update phase
(parameters, gradients, optimizer state, activations) against the compiled update's, with the
ratios. No compile happens here.

    python benchmarks/memory_vs_compiled.py /tmp/aot/table.json [--config gsm8k_hard]
"""

from __future__ import annotations

import argparse
import json

from jaxgrpo.core import presets
from jaxgrpo.planning import memory
from jaxgrpo.settings.loading import load_config

GIB = 1024**3


def rows(reports: list[dict], config: str) -> list[str]:
    out = [
        "| model | tuning | slice | sampling est. | decode compiled | ratio | update est. "
        "| update compiled | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rep in reports:
        f = rep["facts"]
        model = f["model"]
        lora = 16 if f["tuning"] == "LoRA" else 0
        cfg = load_config(config, {"model.source": model, "model.lora_rank": lora})
        model_cfg, run = memory.from_train_config(cfg, f["prompt_len"])
        preset = presets.get_preset(f["topology"])
        est = memory.estimate(model_cfg, run, f["mesh"], preset.hbm_bytes)
        static = est["params"] + est["grads"] + est["opt_state"] + est["ref_params"]
        sampling = static + est["kv_cache"] + est["sample_weights"]
        update = static + est["activations"]
        progs = {p["program"]: p["memory"]["total"] for p in rep["programs"]}
        dec, upd = progs.get("sample/decode"), progs.get("update")
        ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
        out.append(
            f"| {model.removeprefix('random:')} | {f['tuning']} | {f['topology']} "
            f"| {sampling / GIB:.2f} | {(dec or 0) / GIB:.2f} | {ratio(sampling, dec)} "
            f"| {update / GIB:.2f} | {(upd or 0) / GIB:.2f} | {ratio(update, upd)} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table_json")
    parser.add_argument("--config", default="gsm8k_hard")
    args = parser.parse_args()
    with open(args.table_json, encoding="utf-8") as f:
        reports = json.load(f)
    print("\n".join(rows(reports if isinstance(reports, list) else [reports], args.config)))


if __name__ == "__main__":
    main()
