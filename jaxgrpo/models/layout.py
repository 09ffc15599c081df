"""How a run lays out its work on the chips it is compiled for: one `Layout` value, resolved
once where the run is built (`Layout.for_platform`) and carried by `ModelConfig.layout`.

The model, the sampler, the scoring passes and the learner read it as data (which kernel, which
loop, how wide a block); none of them asks which backend it runs on. The default `Layout()` is
the portable one: JAX's own autodiff of the plain math and scanned loops, what a TPU or GPU run
uses. XLA:CPU gets the variants measured faster there (benchmarks/README.md, "Measurements
behind code choices").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxgrpo.models.kernels import ATTENTIONS, PROJECTIONS, SUMS_OF_SQUARES

LOOPS = ("scan", "unroll")

# Rows x positions per LM-head logits block at least, on XLA:CPU: one packed row scored 64
# positions at a time ran the head's [64, 576] x [576, 49152] dots at about two thirds of the
# rate of 256-row blocks (benchmarks/README.md, "LM-head blocks").
CPU_HEAD_CHUNK_ROWS = 256

# The update's token columns per device per micro-batch under `rl.micro_batch_columns = -1`
# ("auto"), on XLA:CPU: the 512-token gsm8k update in 4 micro-batches of one packed row ran
# faster than in one of four (benchmarks/README.md, "The update in micro-batches").
CPU_MICRO_BATCH_COLUMNS = 4096


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run lays out its work (hashable: part of the compiled programs' static config).

    Attributes:
        projection: the projections' kernel (`jaxgrpo.models.kernels.PROJECTIONS`).
        attention: the attention kernel (`kernels.ATTENTIONS`).
        grad_norm: the gradient norm's sum of squares (`kernels.SUMS_OF_SQUARES`).
        layer_loop: "scan" runs the stacked layers under `lax.scan`; "unroll" writes L copies of
            a layer (longer compile, but the backward pass writes no stacked [L, ...] residual
            and gradient buffers: faster for a full fine-tuning update on XLA:CPU, slower with
            LoRA; benchmarks/README.md, "Unrolled layers").
        decode_loop: how the sampler's one-token steps run the layers: "scan" over stacked
            decode weights and a stacked cache (one layer body in the program, so a deep model
            compiles in a fraction of the time), "unroll" over per-layer arrays (on XLA:CPU
            reading layer i out of a stacked buffer copies it at every step).
        head_chunk_rows: rows x positions per LM-head logits block at least (0: the asked
            chunk size).
        micro_batch_columns: token columns per device of one update micro-batch when
            `rl.micro_batch_columns` is -1 ("auto"); 0: `rl.grad_accum`.
        release_memory: hand the heap's freed pages back to the system between a step's
            phases (XLA:CPU allocates its buffers on the host heap, kept for reuse by
            `jaxgrpo.core.host.keep_freed_memory`).
    """

    projection: str = "jax"
    attention: str = "jax"
    grad_norm: str = "jax"
    layer_loop: str = "scan"
    decode_loop: str = "scan"
    head_chunk_rows: int = 0
    micro_batch_columns: int = 0
    release_memory: bool = False

    def __post_init__(self):
        for name, table in (
            ("projection", PROJECTIONS),
            ("attention", ATTENTIONS),
            ("grad_norm", SUMS_OF_SQUARES),
        ):
            if getattr(self, name) not in table:
                raise ValueError(
                    f"Layout.{name}={getattr(self, name)!r}; known kernels: {', '.join(table)}"
                )
        for name in ("layer_loop", "decode_loop"):
            if getattr(self, name) not in LOOPS:
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}; one of {LOOPS}")

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    @property
    def unrolls_layers(self) -> bool:
        return self.layer_loop == "unroll"

    @property
    def scans_decode(self) -> bool:
        return self.decode_loop == "scan"

    @classmethod
    def for_platform(
        cls,
        platform: str,
        *,
        layer_loop: str = "auto",
        lora_rank: int = 0,
        remat: bool = False,
    ) -> Layout:
        """The layout of a run compiled for `platform` ("cpu", "tpu", "gpu"): the only place
        that tells backends apart.

        `layer_loop` is the config's `model.layer_loop`: "auto" unrolls for full fine-tuning
        on CPU without remat, where the unrolled update is faster, and keeps the scan
        otherwise: it slows LoRA's update, and with remat the scan's gradients accumulate in
        place where the unrolled layers' are concatenated (benchmarks/README.md, "Unrolled
        layers").
        """
        cpu = platform == "cpu"
        if layer_loop == "auto":
            layer_loop = "unroll" if cpu and lora_rank == 0 and not remat else "scan"
        if not cpu:
            return cls(layer_loop=layer_loop)
        return cls(
            projection="xla_cpu",
            attention="xla_cpu",
            grad_norm="xla_cpu",
            layer_loop=layer_loop,
            decode_loop="unroll",
            head_chunk_rows=CPU_HEAD_CHUNK_ROWS,
            micro_batch_columns=CPU_MICRO_BATCH_COLUMNS,
            release_memory=True,
        )


def mesh_platform(mesh: Any = None) -> str:
    """The backend a run on `mesh` is compiled for: its devices' platform, or JAX's default
    backend without a mesh."""
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
