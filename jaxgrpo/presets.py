"""Mesh presets per accelerator slice: what the config's ``mesh`` section should say on each.

A preset names a slice as Cloud TPU does (``v5e-8`` is eight v5e chips; ``v4-8`` and ``v5p-8``
are four chips, because those names count TensorCores) and gives its device count, hosts, memory
per device and a mesh for ``jaxgrpo.sharding.TRAIN_RULES``:

* slices up to one host: everything on ``fsdp``, so parameters, optimizer state and batch are
  split over all chips (the rules shard weights' ``embed`` axis over fsdp, activations' batch
  over data x fsdp);
* multi-host slices: ``fsdp`` spans the chips of the fast ICI domain and ``data`` replicates
  across the rest, except on v5p/v4 whose 3D torus keeps fsdp cheap slice-wide.

Use a preset from the command line,

    python -m jaxgrpo.train --config gsm8k_hard.py $(python -m jaxgrpo.presets v5e-64)

which expands to ``--config.mesh.data=... --config.mesh.fsdp=... --config.mesh.tensor=...``, or
in Python with ``apply_preset(config_dict, "v5e-64")``. ``python -m jaxgrpo.presets`` with no
argument prints the table. ``prompts_per_step * group_size`` must divide by data x fsdp.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Preset:
    """One accelerator slice.

    Attributes:
      name: slice name (``v5e-64``).
      devices: JAX devices (chips; one per megacore TensorCore pair on v4/v5p).
      hosts: worker VMs (JAX processes).
      hbm_bytes: accelerator memory per device.
      mesh: ``{"data": ., "fsdp": ., "tensor": .}`` with product ``devices``.
    """

    name: str
    devices: int
    hosts: int
    hbm_bytes: int
    mesh: dict[str, int]

    def flags(self) -> list[str]:
        """``--config.mesh.<axis>=<size>`` overrides for ``python -m jaxgrpo.train``."""
        return [f"--config.mesh.{axis}={size}" for axis, size in self.mesh.items()]


def _preset(name: str, devices: int, hosts: int, hbm_gib: float, data: int = 1, tensor: int = 1):
    fsdp = devices // (data * tensor)
    assert data * fsdp * tensor == devices, name
    mesh = {"data": data, "fsdp": fsdp, "tensor": tensor}
    return Preset(name, devices, hosts, int(hbm_gib * GIB), mesh)


# Chips and HBM per chip from the Cloud TPU system architecture pages; GPUs for comparison.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _preset("cpu-8", 8, 1, 2),  # 8 virtual CPU devices (tests)
        _preset("v4-8", 4, 1, 32),
        _preset("v4-32", 16, 4, 32),
        _preset("v5e-1", 1, 1, 16),
        _preset("v5e-4", 4, 1, 16),
        _preset("v5e-8", 8, 1, 16),
        _preset("v5e-16", 16, 4, 16),
        _preset("v5e-64", 64, 16, 16, data=4),
        _preset("v5e-256", 256, 64, 16, data=16),
        _preset("v5p-8", 4, 1, 95),
        _preset("v5p-128", 64, 16, 95),
        _preset("v6e-1", 1, 1, 32),
        _preset("v6e-8", 8, 1, 32),
        _preset("v6e-64", 64, 16, 32, data=4),
        _preset("v6e-256", 256, 64, 32, data=16),
        _preset("a100-80g-8", 8, 1, 80),
        _preset("h100-8", 8, 1, 80),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (``v5litepod-8`` is accepted for ``v5e-8``).

    Raises:
      KeyError: unknown name; the message lists the known ones.
    """
    key = name.replace("v5litepod-", "v5e-")
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def apply_preset(cfg: Any, name: str) -> Any:
    """Sets ``cfg.mesh.data/fsdp/tensor`` of a config dict to the preset's mesh; returns cfg."""
    for axis, size in get_preset(name).mesh.items():
        cfg.mesh[axis] = size
    return cfg


def table() -> str:
    """Markdown table of every preset."""
    lines = ["| preset | devices | hosts | HBM/device | mesh (data, fsdp, tensor) |"]
    lines.append("|---|---:|---:|---:|---|")
    for p in PRESETS.values():
        m = p.mesh
        lines.append(
            f"| {p.name} | {p.devices} | {p.hosts} | {p.hbm_bytes / GIB:.0f} GiB "
            f"| ({m['data']}, {m['fsdp']}, {m['tensor']}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxgrpo.presets [NAME]``: the flags of NAME, or the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(table())
        return 0
    try:
        print(" ".join(get_preset(argv[0]).flags()))
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
