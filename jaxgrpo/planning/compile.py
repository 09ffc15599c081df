"""``python -m jaxgrpo.compile --config CONFIG --topology v5e-64 [--config.a.b=v ...]``.

Compiles every program of one GRPO step ahead of time for a slice that need not be here (a
TPU topology from libtpu, or ``cpu-N`` virtual CPU devices) with abstract, sharded inputs (no
weights, no network; see ``jaxgrpo.planning.aot``), and reports per program: per-chip memory
(arguments, outputs, temporaries, generated code, aliased) against the chip's HBM with a
verdict, headroom and the knob to turn when it does not fit; analytic FLOPs; the collectives in
the compiled HLO (and in the decode loop's body: one decode step); compile time; and a roofline
estimate of its time and of the step's model FLOP utilisation (an estimate from the published
chip figures, not a measurement). A run with tools (``agent``) has longer prompts (the tools'
description is added to ``--prompt_len``), a first-turn decode that keeps its KV cache, and
one more sampler, ``continue``: an episode's later turns, every row resumed from that cache
with a result appended (``resume``, then ``append`` for the passes of a longer result), then
decoded. A table on
stdout, everything with ``--json OUT``; ``--table`` compiles a models x slices grid
(``TABLE_MODELS`` x ``TABLE_SLICES``) instead.

Asynchronous rollouts (``rl.max_staleness`` >= 1, ``jaxgrpo.planning.split``): with
``mesh.sampler_devices`` = N the sampler's programs compile on the slice's last N chips and
the learner's on the rest, each row naming its side; the report adds the weight transfer per
update and the split step, max(sampler side, learner side) + transfer, beside the synchronous
run's step on the whole slice: compiled in the same call, or read from ``--baseline`` (a
``--json`` report of that run). A sampler side that cannot hold its weights is refused
before anything compiles.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

# jaxgrpo.core.host imports no jax: XLA_FLAGS are set in main first.
from jaxgrpo.core.host import force_host_devices, quiet_libraries

GIB = 1024**3
TABLE_MODELS = (
    "SmolLM2-135M", "Qwen2.5-1.5B", "Qwen2.5-Math-1.5B-Instruct", "Llama-3.1-8B", "Qwen3-8B"
)  # fmt: skip
TABLE_SLICES = ("v5e-8", "v5e-64", "v5p-128", "v6e-64")
# the training step (evaluation is not in it); "continue" only with tools
TABLE_ONLY = ("sample", "continue", "score", "update")


def _set_devices(topology: str) -> None:
    """Before jax is imported: N virtual CPU devices for ``cpu-N``; libtpu may be shared."""
    if topology.startswith("cpu-"):
        force_host_devices(int(topology[4:]))
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Another process on this machine may hold libtpu's lockfile; compiling needs no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


FIELDS = ("arguments", "outputs", "temporaries", "generated_code", "aliased", "resident", "total")


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
    }
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"]
    out["total"] += out["generated_code"] - out["aliased"]
    return out


def _suggest(name: str, mem: dict, cfg: Any) -> str:
    """The knob most likely to make an oversized program fit."""
    if (mem["arguments"] or 0) >= mem["temporaries"]:
        if cfg.model.lora_rank == 0:
            return "model.lora_rank > 0 (LoRA: no optimizer state for the base weights)"
        if cfg.model.param_dtype == "float32":
            return "model.param_dtype='bfloat16'"
        return "a larger slice or mesh.fsdp (weights are split over fsdp x tensor)"
    if name.endswith("decode") or name.endswith("prefill"):
        more = "more mesh.sampler_devices or " if cfg.mesh.sampler_devices else ""
        return f"{more}mesh.tensor > 1, or fewer rl.prompts_per_step / sampling.max_new_tokens"
    if not cfg.model.remat:
        return "model.remat=True"
    if cfg.model.remat_policy == "projections":
        return "model.remat_policy='full'"
    return "a larger rl.grad_accum (smaller micro-batches)"


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def _collectives_text(coll: dict) -> str:
    parts = [f"{k} {v['count']}x {v['bytes'] / 2**20:.1f}MiB" for k, v in sorted(coll.items())]
    return ", ".join(parts) or "none"


def _program_row(p, cfg: Any, facts: dict, chip) -> dict[str, Any]:
    """One program's report: memory and verdict, FLOPs, collectives, times, estimate."""
    from jaxgrpo.planning import hlo, program  # jax-dependent: after the devices are set

    if p.compiled is None:  # refused by the compiler: only the bytes it needed are known
        need, _ = program.oom_bytes(p.oom)
        mem = dict.fromkeys(FIELDS[:-1])
        mem.update(temporaries=need, total=need)
        coll, xla_flops = {"program": {}, "loop_body": {}, "loops": 0}, 0.0
    else:
        mem = _memory(p.compiled)
        coll = hlo.collectives(p.compiled.as_text(), p.loop_trips)
        xla_flops = float(p.compiled.cost_analysis().get("flops", 0.0))
    # What other programs keep on the chips meanwhile (a second model's weights, the
    # policy's state beside the second model's program, a lagging sampler's versions).
    mem["resident"] = int(p.resident_bytes)
    mem["total"] += mem["resident"]
    per_chip = p.flops / p.devices
    terms = dict(
        compute=per_chip / chip.bf16_flops,
        memory=p.weight_bytes / chip.hbm_bw,
        collectives=sum(v["bytes"] for v in coll["program"].values()) / chip.ici_bw,
    )
    fits = p.compiled is not None and mem["total"] <= chip.hbm_bytes
    return dict(
        program=p.name,
        side=p.side,
        devices=p.devices,
        calls=p.calls,
        memory=mem,
        fits=fits,
        headroom_bytes=chip.hbm_bytes - mem["total"],
        suggestion=None if fits else _suggest(p.name, mem, cfg),
        compiler_error=p.oom,
        flops=p.flops,
        model_flops=p.model_flops,
        flops_per_chip=per_chip,
        xla_flops_per_chip=xla_flops,
        collectives=coll["program"],
        loop_body_collectives=coll["loop_body"],
        while_loops=coll["loops"],
        lower_s=p.lower_s,
        compile_s=p.compile_s,
        estimate_s=max(terms["compute"], terms["memory"]) + terms["collectives"],
        estimate_terms_s=terms,
    )


def report(cfg: Any, programs: list, facts: dict, preset) -> dict[str, Any]:
    """The JSON report of one compiled step (see the module docstring).

    The step's memory is its largest program's: every program takes the persistent state
    (weights, optimizer state, reference) as arguments, and they run one at a time on a
    side. With a sampler on devices of its own the step's estimate is the split's
    (``split.summary``), else the programs' sum.
    """
    from jaxgrpo.planning import split

    chip = preset.specs
    hbm = chip.hbm_bytes
    rows = [_program_row(p, cfg, facts, chip) for p in programs]
    sides = split.summary(rows, facts, chip) if "sampler" in facts else None
    step_s = sides["estimate_s"] if sides else sum(r["estimate_s"] * r["calls"] for r in rows)
    step_flops = sum(r["model_flops"] * r["calls"] for r in rows)
    peak = max(r["memory"]["total"] for r in rows)
    mfu = step_flops / (step_s * facts["devices"] * chip.bf16_flops) if step_s else 0.0
    step = dict(
        hbm_per_chip=peak,
        chip_hbm=hbm,
        fits=all(r["fits"] for r in rows),
        headroom_bytes=hbm - peak,
        compile_s=sum(r["compile_s"] + r["lower_s"] for r in rows),
        estimate_s=step_s,
        mfu_estimate=mfu,
        flops=step_flops,
    )
    rep = dict(facts=facts, programs=rows, step=step)
    if sides:
        rep["split"] = sides
    return rep


def _tools_text(facts: dict) -> str:
    tokens = facts.get("tool_prompt_tokens", 0)
    return f" (with ~{tokens} tokens of tool description)" if tokens else ""


def _mesh_text(facts: dict) -> str:
    if "sampler" not in facts:
        return f"mesh {facts['mesh']}"
    sampler = facts["sampler"]
    return (
        f"learner mesh {facts['mesh']} on the first {facts['learner_devices']}, sampler mesh "
        f"{sampler['mesh']} on the last {sampler['devices']}"
    )


def render(rep: dict) -> str:
    """The human-readable table of a report (with a side column when the sampler has devices
    of its own)."""
    from jaxgrpo.planning import split

    f, s = rep["facts"], rep["step"]
    others = "".join(
        f", {name} {m['source']} ({m['params'] / 1e9:.2f} B, frozen)"
        for name, m in f.get("second_models", {}).items()
    )
    sided = "sampler" in f
    lines = [
        f"{f['model']} ({f['tuning']}, {f['params'] / 1e9:.2f} B){others} on {f['topology']}: "
        f"{f['devices']} devices, {f['hosts']} hosts, {_mesh_text(f)}, "
        f"P={f['prompt_len']}{_tools_text(f)}, T={f['max_new_tokens']}, "
        f"sampler rules: {f['sample_rules']}",
        "",
        "| program | " + "side | " * sided + "calls | args GiB | out GiB | temp GiB | code MiB "
        "| alias GiB | resident GiB | total GiB | fits | compile s | TFLOP/chip | est. s "
        "| collectives (per call) | decode-step collectives |",
        "|---|" + "---|" * sided + "---:|" * 8 + "---|---:|---:|---:|---|---|",
    ]
    for r in rep["programs"]:
        m = r["memory"]
        body = _collectives_text(r["loop_body_collectives"]) if "decode" in r["program"] else "-"
        gib = [_gib(m[k]) for k in ("arguments", "outputs", "temporaries")]
        code = "-" if m["generated_code"] is None else f"{m['generated_code'] / 2**20:.1f}"
        verdict = "yes" if r["fits"] else "NO: " + r["suggestion"]
        side = f"{r['side']} | " if sided else ""
        lines.append(
            f"| {r['program']} | {side}{r['calls']} | {' | '.join(gib)} | {code} | "
            f"{_gib(m['aliased'])} | {_gib(m['resident'])} | {_gib(m['total'])} | {verdict} | "
            f"{r['compile_s']:.1f} | "
            f"{r['flops_per_chip'] / 1e12:.2f} | {r['estimate_s']:.3f} | "
            f"{_collectives_text(r['collectives'])} | {body} |"
        )
    verdict = "fits" if s["fits"] else "does NOT fit"
    lines += [
        "",
        f"Step: {verdict} ({s['hbm_per_chip'] / GIB:.2f} of {s['chip_hbm'] / GIB:.0f} GiB per "
        f"chip, headroom {s['headroom_bytes'] / GIB:.2f} GiB); compile {s['compile_s']:.1f} s; "
        f"estimated step {s['estimate_s']:.2f} s, MFU {100 * s['mfu_estimate']:.1f}% "
        "(roofline estimate from the chip table, not a measurement)",
        *split.render_lines(rep),
    ]
    return "\n".join(lines)


def _preset(topology: str):
    """The slice called ``topology``; ``cpu-N`` is N virtual CPU devices, all on fsdp."""
    from jaxgrpo.core import presets  # after _set_devices, like every jaxgrpo import here

    if not topology.startswith("cpu-"):
        return presets.get_preset(topology)
    n = int(topology[4:])
    mesh = {"data": 1, "fsdp": n, "tensor": 1}
    return presets.Preset(topology, n, 1, presets.CHIPS["cpu"].hbm_bytes, mesh)


def compile_config(
    name: str, topology: str, overrides: dict, prompt_len: int = 256, only=None
) -> dict:
    """Compiles config ``name`` (with the slice's preset mesh, then ``overrides``) for
    ``topology`` and returns its report; ``only`` as in ``jaxgrpo.planning.aot.compile_step``."""
    from jaxgrpo.planning import aot, refusals
    from jaxgrpo.settings.loading import load_config
    from jaxgrpo.settings.schema import resolve_mesh_shape

    preset = _preset(topology)
    mesh = {f"mesh.{k}": v for k, v in preset.mesh.items()}
    if any(k.startswith("mesh.") for k in overrides):
        mesh["mesh.fsdp"] = -1  # the overrides reshape the mesh; fsdp takes the rest
    cfg = load_config(name, {**mesh, **overrides})
    sizes = resolve_mesh_shape(cfg, preset.devices)  # the learner's, checked with devices
    refusals.check_second_models(cfg, sizes, preset, prompt_len)
    refusals.check_sampler_side(cfg, sizes, preset, prompt_len)
    programs, facts = aot.compile_step(cfg, preset, prompt_len, only)
    return report(cfg, programs, facts, preset)


def table_rows(reports: list[dict]) -> str:
    """Markdown: model x slice, LoRA and full fine-tuning."""
    lines = [
        "| model | tuning | slice | fits | HBM GiB/chip | compile s | est. step s | est. MFU |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for rep in reports:
        f, s = rep["facts"], rep["step"]
        lines.append(
            f"| {f['model'].removeprefix('random:')} | {f['tuning']} | {f['topology']} | "
            f"{'yes' if s['fits'] else 'no'} | {s['hbm_per_chip'] / GIB:.2f} | "
            f"{s['compile_s']:.0f} | {s['estimate_s']:.1f} | {100 * s['mfu_estimate']:.1f}% |"
        )
    return "\n".join(lines)


def _cell(rep: dict) -> tuple[str, str, str]:
    f = rep["facts"]
    return f["model"].removeprefix("random:"), f["tuning"], f["topology"]


def _table(args, overrides: dict) -> int:
    """Compiles the grid's training step (``TABLE_ONLY``) cell by cell. With ``--json`` each
    cell is written as it finishes, and a rerun keeps the cells the file already has."""
    reports = []
    if args.json and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as f:
            reports = json.load(f)
    done = {_cell(rep) for rep in reports}
    for model in args.models or TABLE_MODELS:
        for lora in (16, 0):
            for topology in args.slices or TABLE_SLICES:
                if (model, "LoRA" if lora else "full", topology) in done:
                    continue
                extra = {"model.source": f"random:{model}", "model.lora_rank": lora}
                try:
                    rep = compile_config(
                        args.config, topology, {**overrides, **extra}, args.prompt_len, TABLE_ONLY
                    )
                except Exception as e:  # a cell that fails to build is reported, not fatal
                    print(f"| {model} | {lora} | {topology} | error: {e} |", flush=True)
                    continue
                reports.append(rep)
                print(table_rows([rep]).splitlines()[-1], flush=True)
                if args.json:
                    with open(args.json + ".tmp", "w", encoding="utf-8") as f:
                        json.dump(reports, f, indent=1, default=float)
                    os.replace(args.json + ".tmp", args.json)
    print(table_rows(reports))
    return 0


def _compare_synchronous(args, overrides: dict, only, rep: dict) -> None:
    """Sets the synchronous run on the whole slice beside a split one: ``--baseline``'s
    report, or the same config compiled again without the lag and the sampler's devices
    (the honest figure for the same programs, at the cost of a second compile)."""
    from jaxgrpo.planning import split

    if args.baseline:
        with open(args.baseline, encoding="utf-8") as f:
            split.compare(rep, json.load(f), f"from {args.baseline}")
        return
    sync = split.synchronous_overrides(overrides)
    baseline = compile_config(args.config, args.topology, sync, args.prompt_len, only)
    split.compare(rep, baseline, "compiled in this call")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m jaxgrpo.compile", description=__doc__)
    parser.add_argument("--config", required=True, help="config file or shipped name")
    parser.add_argument("--topology", default="v5e-8", help="slice (v5e-64, v5p-128, cpu-8, ...)")
    parser.add_argument("--prompt_len", type=int, default=256, help="longest prompt (tokens)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--table", action="store_true", help="models x slices table")
    parser.add_argument(
        "--only",
        nargs="*",
        help="program name prefixes: sample, continue, score, update, eval (all)",
    )
    parser.add_argument(
        "--baseline",
        help="a sampler on devices of its own: the synchronous run's --json report to compare "
        "with (default: compile it too)",
    )
    parser.add_argument("--models", nargs="*", help="--table: architectures (default: the five)")
    parser.add_argument("--slices", nargs="*", help="--table: slices (default: the four)")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    _set_devices(args.topology if not args.table else "v5e-8")
    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="jaxgrpo.planning.compile: %(message)s")
    from jaxgrpo.settings.loading import config_override  # imports jax: after _set_devices

    overrides = dict(config_override(a) for a in rest)
    if args.table:
        return _table(args, overrides)
    try:
        only = tuple(args.only) if args.only else None
        rep = compile_config(args.config, args.topology, overrides, args.prompt_len, only)
        if "split" in rep:
            _compare_synchronous(args, overrides, only, rep)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
