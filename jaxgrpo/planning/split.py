"""Asynchronous rollouts on a slice, for ``python -m jaxgrpo.compile``: the sampler on devices
of its own and the policy versions a lagging sampler keeps.

With ``rl.max_staleness`` = k >= 1 the sampler may sample with a policy up to k updates old.
With ``mesh.sampler_devices`` = N > 0 it owns the slice's last N devices as a mesh of its own
(``jaxgrpo.settings.checks.sampler_mesh_shape``), holding the frozen weights once and up to
k versions of the trainable params (the LoRA adapters under LoRA, every weight otherwise);
after every update the learner's new trainable params move there (``jaxgrpo.rl.sampler_side``).
The two sides then run at once, so a step takes about

    max(sampler side, learner side) + transfer

where each side's time is the sum of its programs' estimates (calls included). This module
estimates the transfer (``transfer``), sums the sides (``summary``), sets the result beside
the synchronous run's report (``compare``) and words it (``render_lines``); a split whose
sampler cannot hold its weights is refused before compiling (``refusals``). With N = 0 the
sampler shares the learner's devices and the run keeps k more copies of the trainable
params there.
"""

from __future__ import annotations

from typing import Any

from jaxgrpo.core.presets import GIB, Chip


def transfer(facts: dict, chip: Chip) -> dict[str, float]:
    """The weight transfer after every update, from the learner's chips to the sampler's.

    Each sampler chip receives its shard of the trainable params, r bytes (every data
    replica its own); the learner's L chips send the N sampler chips' r * N bytes between
    them. A chip's ICI bandwidth in the chip table counts both directions, so one direction
    moves ``ici_bw / 2``:

        seconds = max(r, r * N / L) / (ici_bw / 2)

    A lower bound: every chip's links at their full rate, no hops and no narrower cut
    between the two blocks of chips.
    """
    sampler = facts["sampler"]
    r, n = sampler["trainable_bytes_per_chip"], sampler["devices"]
    sent = r * n / facts["learner_devices"]
    return dict(
        bytes=facts["transfer_bytes"],
        bytes_per_sampler_chip=r,
        bytes_per_learner_chip=sent,
        estimate_s=max(r, sent) / (chip.ici_bw / 2),
    )


def summary(rows: list[dict], facts: dict, chip: Chip) -> dict[str, Any]:
    """The split step from the report's program rows (each with its ``side``): each side's
    devices, mesh, peak memory per chip and summed estimate, the transfer, and
    ``estimate_s`` = max(sampler side, learner side) + transfer."""
    sides = {}
    for side, devices, mesh in (
        ("sampler", facts["sampler"]["devices"], facts["sampler"]["mesh"]),
        ("learner", facts["learner_devices"], facts["mesh"]),
    ):
        mine = [r for r in rows if r["side"] == side]
        sides[side] = dict(
            devices=devices,
            mesh=mesh,
            estimate_s=sum(r["estimate_s"] * r["calls"] for r in mine),
            hbm_per_chip=max((r["memory"]["total"] for r in mine), default=0),
            programs=[r["program"] for r in mine],
        )
    move = transfer(facts, chip)
    slowest = max(sides["sampler"]["estimate_s"], sides["learner"]["estimate_s"])
    return dict(**sides, transfer=move, estimate_s=slowest + move["estimate_s"])


def synchronous_overrides(overrides: dict) -> dict:
    """The same run's overrides made synchronous on the whole slice: no lag, no sampler
    devices (the preset's mesh, unless other mesh keys are set)."""
    out = {k: v for k, v in overrides.items() if k != "mesh.sampler_devices"}
    out.update({"rl.max_staleness": 0, "rl.stale_batches": "wait"})
    return out


def compare(rep: dict, sync: dict, source: str) -> None:
    """Sets the synchronous run's step (``sync``, a report of the same config on the whole
    slice; ``source`` says where it came from) beside the split's, in ``rep["split"]``."""
    f, s = sync["facts"], sync["step"]
    if (f["topology"], f["model"]) != (rep["facts"]["topology"], rep["facts"]["model"]):
        raise ValueError(
            f"--baseline: its report is of {f['model']} on {f['topology']}, not "
            f"{rep['facts']['model']} on {rep['facts']['topology']}"
        )
    rep["split"]["synchronous"] = dict(
        source=source,
        devices=f["devices"],
        mesh=f["mesh"],
        estimate_s=s["estimate_s"],
        hbm_per_chip=s["hbm_per_chip"],
        compile_s=s["compile_s"],
        programs={
            r["program"]: dict(calls=r["calls"], estimate_s=r["estimate_s"], memory=r["memory"])
            for r in sync["programs"]
        },
    )


def _peak(side: dict) -> str:
    if not side["programs"]:
        return "none compiled"
    return f"peak {side['hbm_per_chip'] / GIB:.2f} GiB per chip"


def render_lines(rep: dict) -> list[str]:
    """The report's lines on the lag: the two sides, the transfer and the split step; or the
    extra versions a lagging sampler keeps on shared devices."""
    f = rep["facts"]
    k = f.get("max_staleness", 0)
    if "sampler" not in f:
        if not k:
            return []
        extra = k * f["trainable_bytes_per_chip"]
        return [
            f"rl.max_staleness={k} on shared devices: {k} extra cop{'ies' if k > 1 else 'y'} "
            f"of the trainable params ({extra / GIB:.2f} GiB per chip) in every program's "
            "resident memory"
        ]
    sp = rep["split"]
    smp, lrn, move = sp["sampler"], sp["learner"], sp["transfer"]
    what = "LoRA adapters" if f["tuning"] == "LoRA" else "all weights"
    lines = [
        f"Sampler: the last {smp['devices']} chips, mesh {smp['mesh']}, {_peak(smp)} (frozen "
        f"weights {f['sampler']['frozen_bytes_per_chip'] / GIB:.2f} GiB and {k} trainable "
        f"version(s) of {f['sampler']['trainable_bytes_per_chip'] / GIB:.3f} GiB each); "
        f"learner: {lrn['devices']} chips, mesh {lrn['mesh']}, {_peak(lrn)}",
        f"Weight transfer per update: {move['bytes'] / 2**20:.1f} MiB ({what}), "
        f"{move['bytes_per_sampler_chip'] / 2**20:.2f} MiB into each sampler chip, est. "
        f"{1e3 * move['estimate_s']:.3f} ms (max(in, out per chip) / half the ICI bandwidth: "
        "a lower bound)",
        f"Estimated split step: max(sampler {smp['estimate_s']:.2f} s, learner "
        f"{lrn['estimate_s']:.2f} s) + transfer {move['estimate_s']:.4f} s = "
        f"{sp['estimate_s']:.2f} s",
    ]
    sync = sp.get("synchronous")
    if sync:
        lines.append(
            f"Synchronous on all {sync['devices']} chips (mesh {sync['mesh']}; {sync['source']})"
            f": estimated step {sync['estimate_s']:.2f} s, peak "
            f"{sync['hbm_per_chip'] / GIB:.2f} GiB per chip, compile {sync['compile_s']:.1f} s"
        )
    return lines
