"""Accelerator slices and model architectures: the facts a run is planned against.

Two tables, each the single owner of its facts:

* ``PRESETS``: slices by their Cloud TPU names (``v5e-8`` is eight v5e chips; ``v4-8`` and
  ``v5p-8`` are four chips, because those names count TensorCores), each with its device count,
  hosts, per-chip HBM, peak bf16 FLOP/s, HBM and ICI bandwidth (the published Cloud TPU
  figures), the ``jax.experimental.topologies`` description that lets ``jaxgrpo.planning.compile``
  build the slice's TPU programs on a CPU, and a mesh for ``jaxgrpo.core.sharding.TRAIN_RULES``:

  - up to 32 chips: everything on ``fsdp``, so parameters, optimizer state and batch are split
    over all chips (the rules shard weights' ``embed`` axis over fsdp, activations' batch over
    data x fsdp);
  - 64 chips and more: ``tensor=4`` over the chips of one host, ``fsdp=16`` and ``data`` for the
    rest. Tensor parallelism inside a host keeps a micro-batch of 32 sequences (the seed
    study's gsm8k_hard) divisible over data x fsdp, and lets the sampler decode an 8B model on
    16 GiB chips without gathering weights at every token (``sharding.sampling_rules``).

* ``ARCHITECTURES``: the ``config.json`` fields of common checkpoints, so a run can be planned
  or compiled (and ``model.source = "random:<name>"`` built) without a download.

Use a preset from the command line,

    python -m jaxgrpo.train --config gsm8k_hard.py $(python -m jaxgrpo.presets v5e-64)

which expands to ``--config.mesh.data=... --config.mesh.fsdp=... --config.mesh.tensor=...``, or
in Python with ``apply_preset(config_dict, "v5e-64")``. ``python -m jaxgrpo.presets`` with no
argument prints the table. A micro-batch of sequences must divide by data x fsdp
(``jaxgrpo.settings.checks.check_batch_layout``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

GIB = 1024**3
RANDOM_PREFIX = "random:"  # model.source "random:<name>": random weights of that shape


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures of one accelerator generation.

    Attributes:
      hbm_bytes: accelerator memory per device.
      bf16_flops: peak dense bf16 FLOP/s.
      hbm_bw: HBM bandwidth, bytes/s.
      ici_bw: bidirectional inter-chip interconnect bandwidth per chip, bytes/s.
      device_kind: ``jax.Device.device_kind`` of the chip (to recognise a mesh's devices).
    """

    hbm_bytes: int
    bf16_flops: float
    hbm_bw: float
    ici_bw: float
    device_kind: str


# Cloud TPU system architecture pages (v4, v5e, v5p, v6e); the CPU row is nominal (tests).
CHIPS: dict[str, Chip] = {
    "v4": Chip(32 * GIB, 275e12, 1228e9, 300e9, "TPU v4"),
    "v5e": Chip(16 * GIB, 197e12, 819e9, 400e9, "TPU v5 lite"),
    "v5p": Chip(95 * GIB, 459e12, 2765e9, 1200e9, "TPU v5"),
    "v6e": Chip(32 * GIB, 918e12, 1640e9, 800e9, "TPU v6 lite"),
    "cpu": Chip(2 * GIB, 1e11, 2e10, 1e10, "cpu"),
    "a100": Chip(80 * GIB, 312e12, 2039e9, 600e9, "NVIDIA A100-SXM4-80GB"),
    "h100": Chip(80 * GIB, 989e12, 3350e9, 900e9, "NVIDIA H100 80GB HBM3"),
    "h200": Chip(141 * 10**9, 989e12, 4800e9, 900e9, "NVIDIA H200"),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """One accelerator slice.

    Attributes:
      name: slice name (``v5e-64``).
      devices: JAX devices (chips; one per megacore TensorCore pair on v4/v5p).
      hosts: worker VMs (JAX processes).
      hbm_bytes: accelerator memory per device.
      mesh: ``{"data": ., "fsdp": ., "tensor": .}`` with product ``devices``.
      chip: the generation's key in ``CHIPS``.
      topology: ``get_topology_desc`` name (``v5e:8x8``), None for CPU/GPU presets.
      chips_per_host: ``chips_per_host_bounds`` of that description.
    """

    name: str
    devices: int
    hosts: int
    hbm_bytes: int
    mesh: dict[str, int]
    chip: str = "cpu"
    topology: str | None = None
    chips_per_host: tuple[int, int, int] = (1, 1, 1)

    @property
    def specs(self) -> Chip:
        """The per-chip figures."""
        return CHIPS[self.chip]

    def flags(self) -> list[str]:
        """``--config.mesh.<axis>=<size>`` overrides for ``python -m jaxgrpo.train``."""
        return [f"--config.mesh.{axis}={size}" for axis, size in self.mesh.items()]


def _mesh(devices: int) -> dict[str, int]:
    """The preset mesh of a slice (see the module docstring)."""
    if devices <= 32:
        return {"data": 1, "fsdp": devices, "tensor": 1}
    return {"data": devices // 64, "fsdp": 16, "tensor": 4} if devices >= 64 else {}


def _tpu(name: str, grid: str, chip: str) -> Preset:
    """A TPU slice from its topology grid (``"8x8"``, ``"4x4x4"``)."""
    dims = [int(x) for x in grid.split("x")]
    devices = 1
    for d in dims:
        devices *= d
    if devices <= 8 and chip in ("v5e", "v6e"):
        per_host = (min(dims[0], 2), dims[1] if len(dims) > 1 else 1, 1)  # one host
    else:
        per_host = (2, 2, 1)
    hosts = max(1, devices // (per_host[0] * per_host[1] * per_host[2]))
    return Preset(
        name,
        devices,
        hosts,
        CHIPS[chip].hbm_bytes,
        _mesh(devices),
        chip,
        f"{chip}:{grid}",
        per_host,
    )


def _gpu(name: str, devices: int, chip: str) -> Preset:
    return Preset(name, devices, 1, CHIPS[chip].hbm_bytes, _mesh(devices), chip)


_SLICES = {
    "v4": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4"},
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"},
    "v5p": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 64: "8x8", 256: "16x16"},
}  # fmt: skip

PRESETS: dict[str, Preset] = {
    "cpu-8": Preset("cpu-8", 8, 1, CHIPS["cpu"].hbm_bytes, _mesh(8)),  # virtual CPU devices
    **{
        f"{chip}-{n}": _tpu(f"{chip}-{n}", grid, chip)
        for chip, sizes in _SLICES.items()
        for n, grid in sizes.items()
    },
    "a100-80g-8": _gpu("a100-80g-8", 8, "a100"),
    "h100-8": _gpu("h100-8", 8, "h100"),
    "h200-1": _gpu("h200-1", 1, "h200"),
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


def chip_of(device: Any) -> Chip:
    """The ``CHIPS`` entry of a JAX device (by ``device_kind``; CPU for anything unknown)."""
    kind = getattr(device, "device_kind", "cpu")
    for chip in CHIPS.values():
        if chip.device_kind == kind:
            return chip
    return CHIPS["cpu"]


def apply_preset(cfg: Any, name: str) -> Any:
    """Sets ``cfg.mesh.data/fsdp/tensor`` of a config dict to the preset's mesh; returns cfg."""
    for axis, size in get_preset(name).mesh.items():
        cfg.mesh[axis] = size
    return cfg


# ----------------------------------------------------------------------------------------------
# Architectures: the config.json fields of each checkpoint (as Hugging Face spells them).

_LLAMA31_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)


def _llama(v, d, f, layers, n, k, h, rope, tie, eps=1e-5, max_pos=131072):
    return dict(model_type="llama", vocab_size=v, hidden_size=d, intermediate_size=f,
                num_hidden_layers=layers, num_attention_heads=n, num_key_value_heads=k,
                head_dim=h, rope_scaling=rope, rope_theta=rope["rope_theta"],
                tie_word_embeddings=tie, rms_norm_eps=eps,
                max_position_embeddings=max_pos)  # fmt: skip


def _qwen(arch, v, d, f, layers, n, k, h, tie, theta=1e6, max_pos=32768):
    return dict(model_type=arch, vocab_size=v, hidden_size=d, intermediate_size=f,
                num_hidden_layers=layers, num_attention_heads=n, num_key_value_heads=k,
                head_dim=h, rope_theta=theta, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                max_position_embeddings=max_pos)  # fmt: skip


def _smollm(v, d, f, layers, n, k, theta, max_pos=8192):
    rope = dict(rope_type="default", rope_theta=theta)
    return _llama(v, d, f, layers, n, k, d // n, rope, True, 1e-5, max_pos)


_LLAMA_8B = _llama(128256, 4096, 14336, 32, 32, 8, 128, _LLAMA31_ROPE, False)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": _smollm(49152, 576, 1536, 30, 9, 3, 100000.0),
    "SmolLM2-360M": _smollm(49152, 960, 2560, 32, 15, 5, 100000.0),
    "SmolLM2-1.7B": _smollm(49152, 2048, 8192, 24, 32, 32, 130000.0),
    "Qwen2.5-0.5B": _qwen("qwen2", 151936, 896, 4864, 24, 14, 2, 64, True),
    "Qwen2.5-1.5B": _qwen("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, True),
    "Qwen2.5-Math-1.5B-Instruct": _qwen("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, True,
                                        theta=10000.0, max_pos=4096),
    "Qwen2.5-7B": _qwen("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False, max_pos=131072),
    "Qwen2.5-32B": _qwen("qwen2", 152064, 5120, 27648, 64, 40, 8, 128, False, max_pos=131072),
    "Qwen3-0.6B": _qwen("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, True, max_pos=40960),
    "Qwen3-1.7B": _qwen("qwen3", 151936, 2048, 6144, 28, 16, 8, 128, True, max_pos=40960),
    "Qwen3-4B": _qwen("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, True, max_pos=40960),
    "Qwen3-8B": _qwen("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False, max_pos=40960),
    "Qwen3-14B": _qwen("qwen3", 151936, 5120, 17408, 40, 40, 8, 128, False, max_pos=40960),
    "Llama-3.2-1B": _llama(128256, 2048, 8192, 16, 32, 8, 64, _LLAMA32_ROPE, True),
    "Llama-3.2-3B": _llama(128256, 3072, 8192, 28, 24, 8, 128, _LLAMA32_ROPE, True),
    "Llama-3.1-8B": _LLAMA_8B,
    "Llama-3.1-8B-Instruct": _LLAMA_8B,
    "Meta-Llama-3.1-8B-Instruct-abliterated": _LLAMA_8B,  # mlabonne's copy (gsm8k_hard)
    "Llama-3.1-70B": _llama(128256, 8192, 28672, 80, 64, 8, 128, _LLAMA31_ROPE, False),
}  # fmt: skip


def find_architecture(source: str) -> str | None:
    """The ``ARCHITECTURES`` name that ``source`` (a name or hub id) refers to, or None.

    ``org/Name`` matches ``Name``; otherwise the longest table name contained in the source
    (case-insensitive, ``meta-llama`` read as ``llama``) wins.
    """
    tail = source.rsplit("/", 1)[-1]
    for name in ARCHITECTURES:
        if name.lower() == tail.lower():
            return name
    text = source.lower().replace("meta-llama", "llama")
    hits = [name for name in ARCHITECTURES if name.lower() in text]
    return max(hits, key=len) if hits else None


def hf_config(name: str) -> dict[str, Any]:
    """The ``config.json`` dict of architecture ``name`` (see ``find_architecture``).

    Raises:
      KeyError: unknown name; the message lists the known ones.
    """
    key = find_architecture(name)
    if key is None:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return dict(ARCHITECTURES[key])


def table() -> str:
    """Markdown table of every preset."""
    lines = ["| preset | devices | hosts | HBM/device | mesh (data, fsdp, tensor) | topology |"]
    lines.append("|---|---:|---:|---:|---|---|")
    for p in PRESETS.values():
        m = p.mesh
        lines.append(
            f"| {p.name} | {p.devices} | {p.hosts} | {p.hbm_bytes / GIB:.0f} GiB "
            f"| ({m['data']}, {m['fsdp']}, {m['tensor']}) | {p.topology or '-'} |"
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
