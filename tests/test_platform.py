"""The allocator settings the CLIs run with (`jaxgrpo.platform`), in this process: conftest
applies `keep_freed_memory` as the CLIs do."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo import platform

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not platform._keeping, reason="glibc's mallopt is not available here")
def test_release_freed_memory_returns_the_kept_heap():
    """Freed memory stays resident under `keep_freed_memory` (the next program reuses it)
    until `release_freed_memory` hands its pages back."""
    size = 256 * MIB
    block = np.ones(size, np.uint8)  # touched: resident
    before = _rss_bytes()
    del block
    kept = _rss_bytes()
    assert before - kept < size // 4, "the freed block should stay resident (kept heap)"
    assert platform.release_freed_memory()
    assert kept - _rss_bytes() > size * 3 // 4, "its pages should go back to the kernel"


@pytest.mark.skipif(not platform._keeping, reason="glibc's mallopt is not available here")
def test_compiling_a_program_returns_the_kept_heap():
    """A compilation ends with the kept heap trimmed, so the compiler's working memory does not
    stay resident under the program's first run."""
    size = 256 * MIB
    block = np.ones(size, np.uint8)
    del block
    kept = _rss_bytes()
    offset = float(np.random.default_rng().integers(1 << 30))  # a program no cache holds
    jax.jit(lambda x: x * 3.0 + offset)(jnp.ones(7)).block_until_ready()
    assert kept - _rss_bytes() > size * 3 // 4, "the freed block should go back after compiling"


def test_forced_host_devices_turn_the_compilation_cache_off(monkeypatch, tmp_path):
    """Several forced host devices: no persistent cache, whatever JAXGRPO_CACHE_DIR says (their
    in-process collectives deadlocked on programs read back from it); one device: the cache."""
    monkeypatch.setenv(platform.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4")
    assert platform.forced_host_devices() == 4
    assert platform.compilation_cache_dir() is None
    assert "4 forced host devices" in platform.cache_off_why()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert platform.compilation_cache_dir() == str(tmp_path) and platform.cache_off_why() == ""
    monkeypatch.delenv("XLA_FLAGS")
    assert platform.forced_host_devices() == 1 and platform.compilation_cache_dir() == str(tmp_path)
