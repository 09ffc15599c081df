"""The memory estimate as printed tables, and the ``python -m jaxgrpo.memory`` command line.

``report`` is one run's estimate part by part on one slice (with ``mesh.sampler_devices`` > 0
the learner's part on its devices and the sampler's on its own, ``split_meshes``);
``fit_table`` is which model sizes fit on which slices (launch/README.md's table). The
arithmetic is ``jaxgrpo.planning.memory``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxgrpo.core.presets import ARCHITECTURES, GIB, PRESETS, get_preset
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.planning import memory
from jaxgrpo.settings.checks import sampler_mesh_shape
from jaxgrpo.settings.loading import config_override, load_config

# Architectures that repeat another one's shape: left out of the fit table.
TABLE_DUPLICATES = ("Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B-Instruct-abliterated")
# Parts printed only when a run has them: a lagging sampler's versions on shared devices, and
# the sampling parts, which a learner whose sampler has devices of its own does not hold.
OPTIONAL_PARTS = ("stale_params", "kv_cache", "sample_weights")


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def split_meshes(cfg, preset: str) -> tuple[dict[str, int], dict[str, int]]:
    """(the learner's mesh, the sampler's) when ``cfg.mesh.sampler_devices`` = N > 0 on
    ``preset``: the preset's data and tensor axes with fsdp over all but the last N devices,
    and the sampler's mesh over those (``checks.sampler_mesh_shape``)."""
    p, n = get_preset(preset), cfg.mesh.sampler_devices
    fixed = p.mesh["data"] * p.mesh["tensor"]
    if n >= p.devices or (p.devices - n) % fixed:
        raise ValueError(
            f"mesh.sampler_devices: {n} of {p.name}'s {p.devices} devices leaves the learner "
            f"{p.devices - n}, not a multiple of the preset's data x tensor = {fixed}"
        )
    learner = {**p.mesh, "fsdp": (p.devices - n) // fixed}
    return learner, sampler_mesh_shape(cfg, learner)


def report(
    cfg: ModelConfig,
    run: memory.RunShape,
    preset: str | None,
    second: dict[str, ModelConfig] | None = None,
    sides: tuple[dict[str, int], dict[str, int]] | None = None,
) -> str:
    """A Markdown table of ``estimate`` for one run (on a preset's mesh, or one device), with
    a line for each frozen second model (``memory.second_models``); with ``sides`` (the
    learner's and the sampler's meshes, ``split_meshes``) the learner's table on its mesh and
    the sampler's own (``memory.sampler_side``).

    On a preset whose data x fsdp does not divide the run's micro-batch, the estimate is for
    the largest ``grad_accum`` that does (``fitting_grad_accum``), and the report says so.
    """
    p = get_preset(preset) if preset else None
    if run.sampler_devices and not (p and sides):
        return "mesh.sampler_devices > 0 splits a slice: name it with --preset"
    mesh = sides[0] if sides else p.mesh if p else None
    note = ""
    if p:
        shards = mesh["data"] * mesh["fsdp"]
        g = memory.fitting_grad_accum(run, mesh)
        if g == 0:
            return (
                f"{p.name}: a batch of {run.prompts * run.group} sequences cannot split over "
                f"data x fsdp = {shards} devices; raise rl.prompts_per_step or rl.group_size"
            )
        if g != run.grad_accum:
            note = (
                f"rl.grad_accum={run.grad_accum} gives micro-batches that do not split over "
                f"data x fsdp = {shards} devices: estimated with --config.rl.grad_accum={g}\n\n"
            )
            run = run.with_grad_accum(g)
    est = memory.estimate(cfg, run, mesh, p.hbm_bytes if p else None, second)
    where = f"{p.name} mesh {mesh}" if p else "one device"
    if sides:
        where = f"{p.name}, the learner's first {p.devices - run.sampler_devices}: mesh {mesh}"
    others = "".join(
        f", {name} {memory.base_param_count(m) / 1e9:.3f} B parameters (frozen)"
        for name, m in (second or {}).items()
    )
    lines = [
        f"{note}Memory per device, {where}: {memory.base_param_count(cfg) / 1e9:.3f} B base "
        f"parameters, {memory.lora_param_count(cfg) / 1e6:.2f} M LoRA parameters{others}, "
        f"grad_accum {run.grad_accum}",
        "",
        "| part | GiB |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {_gib(v)} |" for k, v in est.items() if v or k not in OPTIONAL_PARTS]
    if p:
        lines.append(_verdict(est["total"], p.hbm_bytes))
    if run.max_staleness and not sides:
        lines.append(
            f"stale_params: rl.max_staleness = {run.max_staleness} extra copies of the "
            "trainable params, the versions the sampler may still sample with"
        )
    if sides:
        lines += _sampler_lines(cfg, run, p, sides[1])
    return "\n".join(lines)


def _verdict(total: float, hbm_bytes: float) -> str:
    verdict = "fits" if total <= 0.9 * hbm_bytes else "does NOT fit"
    return f"\n{verdict} in {hbm_bytes / GIB:.0f} GiB per device (90% usable)"


def _sampler_lines(cfg: ModelConfig, run: memory.RunShape, p, mesh: dict[str, int]) -> list:
    """The sampler's own devices, part by part (``memory.sampler_side``)."""
    est = memory.sampler_side(cfg, run, mesh, p.hbm_bytes)
    lines = [
        "",
        f"Sampler, {p.name}'s last {run.sampler_devices} devices: mesh {mesh}, "
        f"{run.max_staleness} version(s) of the trainable params",
        "",
        "| part | GiB |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {_gib(v)} |" for k, v in est.items()]
    return lines + [_verdict(est["total"], p.hbm_bytes)]


def fit_table(
    run: memory.RunShape, presets: Sequence[str], lora_rank: int = 16, remat_policy: str = "full"
) -> str:
    """Markdown: GiB per device of each known model (LoRA and full FT) on each preset, in
    bfloat16 with remat keeping what ``remat_policy`` says.

    A cell is ``total GiB`` with a check mark when it fits in 90% of the device memory. A
    preset whose data x fsdp does not divide the run's micro-batch is estimated with its
    ``fitting_grad_accum`` (named under the table; "-" when no grad_accum splits).
    """
    runs = {
        p: run.with_grad_accum(memory.fitting_grad_accum(run, PRESETS[p].mesh)) for p in presets
    }
    header = "| model | params | tuning | " + " | ".join(presets) + " |"
    lines = [header, "|---|---:|---|" + "---:|" * len(presets)]
    for name, fields in ARCHITECTURES.items():
        if name in TABLE_DUPLICATES:
            continue
        base = dict(dtype="bfloat16", param_dtype="bfloat16", remat=True, remat_policy=remat_policy)
        for tuning, lora in (("LoRA", LoRAConfig(rank=lora_rank)), ("full", None)):
            cfg = ModelConfig.from_hf_config(fields, **base, lora=lora)
            cells = []
            for preset in presets:
                p = PRESETS[preset]
                if runs[preset].grad_accum == 0:
                    cells.append("-")
                    continue
                total = memory.estimate(cfg, runs[preset], p.mesh, p.hbm_bytes)["total"]
                mark = "✓" if total <= 0.9 * p.hbm_bytes else "✗"
                cells.append(f"{total / GIB:.1f} {mark}")
            count = f"{memory.base_param_count(cfg) / 1e9:.2f} B"
            lines.append(f"| {name} | {count} | {tuning} | " + " | ".join(cells) + " |")
    changed = [p for p in presets if runs[p].grad_accum != run.grad_accum]
    if changed:
        notes = ", ".join(f"{p} grad_accum={runs[p].grad_accum}" for p in changed)
        lines.append(
            f"\nMicro-batches must split over data x fsdp: {notes} (instead of "
            f"{run.grad_accum}; '-' = no grad_accum splits)."
        )
    return "\n".join(lines)


TABLE_PRESETS = ("v5e-8", "v6e-8", "v5p-8", "v5e-64", "v5p-128")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``--config X [--preset P] [--model M] [--prompt_len P] [--config.a.b=v ...]`` or
    ``--table``."""
    parser = argparse.ArgumentParser(prog="python -m jaxgrpo.memory", description=memory.__doc__)
    parser.add_argument("--config", help="config file or shipped name")
    parser.add_argument("--preset", help=f"slice: {', '.join(PRESETS)}")
    parser.add_argument("--model", help="model source or known name instead of model.source")
    parser.add_argument("--prompt_len", type=int, default=256, help="prompt bucket length P")
    parser.add_argument("--table", action="store_true", help="models x slices fit table")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    overrides = dict(config_override(a) for a in rest)
    try:
        if args.table:
            name = args.config or "gsm8k_hard"
            cfg = load_config(name, overrides)
            _, run = memory.from_train_config(cfg, args.prompt_len, "tiny")
            policy = cfg.model.remat_policy
            remat = "remat" if policy == "full" else f"remat keeping {policy}"
            print(f"GiB per device (bf16, {remat}, {name}: {run}); ✓ = fits in 90% of HBM\n")
            print(fit_table(run, TABLE_PRESETS, remat_policy=policy))
            return 0
        if not args.config:
            parser.error("--config (or --table) is required")
        cfg = load_config(args.config, overrides)
        model_cfg, run = memory.from_train_config(cfg, args.prompt_len, args.model)
        sides = split_meshes(cfg, args.preset) if run.sampler_devices and args.preset else None
        print(report(model_cfg, run, args.preset, memory.second_models(cfg), sides))
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
