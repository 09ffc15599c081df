"""XLA-compiled generation: KV-cache prefill + ``while_loop`` decode, traced knobs, schedules.

``from jaxgrpo.sampling import generate`` is the entry point and ``SamplerSettings`` its
settings, passed whole; ``loop`` holds the model-free core (tested with a fake model),
``select`` the token choice, ``schedules`` the temperature schedules the trainer feeds,
``resume`` an episode's later turns from the KV cache the turn before kept.
"""

from jaxgrpo.sampling.generate import (
    SampleOutput,
    compiled_programs,
    generate,
    generate_from_state,
    make_knobs,
    sampler_programs,
)
from jaxgrpo.sampling.loop import Knobs, LoopConfig, SamplingState, StopReason, decode, prefill
from jaxgrpo.sampling.resume import resume_from_state
from jaxgrpo.sampling.schedules import (
    constant,
    cosine,
    exponential,
    linear,
    make_schedule,
    piecewise,
    temperatures,
)
from jaxgrpo.sampling.select import select_tokens, truncate
from jaxgrpo.sampling.settings import SamplerSettings

__all__ = [
    "Knobs",
    "LoopConfig",
    "SampleOutput",
    "SamplerSettings",
    "SamplingState",
    "StopReason",
    "compiled_programs",
    "constant",
    "cosine",
    "decode",
    "exponential",
    "generate",
    "generate_from_state",
    "linear",
    "make_knobs",
    "make_schedule",
    "piecewise",
    "prefill",
    "resume_from_state",
    "sampler_programs",
    "select_tokens",
    "temperatures",
    "truncate",
]
