"""One compiled program of a step, ahead of time: lowering and compiling it, and what the
report reads of it (``Program``); the compiler's out-of-memory message read back into bytes.

``jaxgrpo.planning.aot`` and ``jaxgrpo.planning.sampler_aot`` lower the step's jitted
functions with abstract, sharded arguments through ``compile_program``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any

import jax


@dataclasses.dataclass
class Program:
    """One compiled program of the step and what the report says about it.

    Attributes:
      name: ``sample/prefill``, ``sample/decode``, ``reference``, ``update``, ...
      calls: times the step runs it (at most, for the sampler of later turns).
      compiled: the ``jax.stages.Compiled``.
      lower_s / compile_s: seconds to lower and to compile.
      flops: analytic FLOPs of one call, whole mesh (with remat's recomputation).
      model_flops: the same without recomputation (what MFU counts).
      weight_bytes: parameter bytes per chip read by one call (roofline estimate).
      loop_trips: trip count assumed for while loops XLA cannot count (the decode loop: T).
      oom: the compiler's message when it refused the program for exceeding the chip's
        memory (``compiled`` is then None).
      owner: whose weights it runs: "policy", "teacher" or "reward_model[i]".
      resident_bytes: bytes per chip that stay on the device while it runs but are not its
        arguments (``frozen.set_resident``): a second model's weights beside the policy's
        programs, the policy's state beside the second model's, the trainable params'
        other versions a lagging sampler keeps.
      side: "sampler" (the rollouts' prefill and decode, evaluation's) or "learner" (scoring
        passes, reward models, the update); with ``mesh.sampler_devices`` > 0 the two run on
        different devices.
      devices: the devices of the mesh it was lowered on (its FLOPs split over them).
    """

    name: str
    calls: int
    compiled: Any
    lower_s: float
    compile_s: float
    flops: float
    model_flops: float
    weight_bytes: float
    loop_trips: int = 1
    oom: str | None = None
    owner: str = "policy"
    resident_bytes: float = 0.0
    side: str = "learner"
    devices: int = 1


def compile_program(
    name, jitted, args, calls, flops, weight_bytes, loop_trips=1, kwargs=None
) -> Program:
    """Lowers and compiles ``jitted`` on ``args`` (and static ``kwargs``); ``flops`` is
    (hardware, model) FLOPs. A program XLA:TPU refuses for its memory comes back with
    ``compiled`` None and the compiler's message."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **(kwargs or {}))
    mid = time.perf_counter()
    oom = None
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program that cannot fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        compiled, oom = None, str(e)
    end = time.perf_counter()
    logging.info("compiled %s in %.1f s (lowered in %.1f s)", name, end - mid, mid - start)
    return Program(
        name, calls, compiled, mid - start, end - mid, *flops, weight_bytes, loop_trips, oom
    )


_OOM = re.compile(
    r"required for ([\w ]+?) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)


def oom_bytes(message: str) -> tuple[int, int]:
    """(bytes needed, bytes available) from XLA:TPU's out-of-memory message; (0, 0) when
    the message says neither."""
    m = _OOM.search(message)
    if not m:
        return 0, 0
    size = lambda x, unit: int(float(x) * 1024 ** ("KMGT".index(unit) + 1))  # noqa: E731
    return size(m.group(2), m.group(3)), size(m.group(4), m.group(5))
