"""jaxgrpo: group-relative RL (GRPO, Dr. GRPO, DAPO, GR-REINFORCE) for Llama/Qwen in JAX/Flax.

Nothing runs at import time: the public entry points are imported lazily so that
``import jaxgrpo`` touches neither the network nor global JAX state.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_model": ("jaxgrpo.run.build", "load_source"),  # every model source, run dirs too
    "generate": ("jaxgrpo.sampling", "generate"),
    "train": ("jaxgrpo.run.train", "run"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxgrpo' has no attribute {name!r}")
