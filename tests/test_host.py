"""The process set-up the CLIs run with (`jaxgrpo.core.host`): the allocator settings, in this
process (conftest applies `keep_freed_memory` as the CLIs do), and the TPU runtime left out
on a host without TPU chips."""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.core import host

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not host._keeping, reason="glibc's mallopt is not available here")
def test_release_freed_memory_returns_the_kept_heap():
    """Freed memory stays resident under `keep_freed_memory` (the next program reuses it)
    until `release_freed_memory` hands its pages back."""
    size = 256 * MIB
    block = np.ones(size, np.uint8)  # touched: resident
    before = _rss_bytes()
    del block
    kept = _rss_bytes()
    assert before - kept < size // 4, "the freed block should stay resident (kept heap)"
    assert host.release_freed_memory()
    assert kept - _rss_bytes() > size * 3 // 4, "its pages should go back to the kernel"


@pytest.mark.skipif(not host._keeping, reason="glibc's mallopt is not available here")
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
    monkeypatch.setenv(host.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4")
    assert host.forced_host_devices() == 4
    assert host.compilation_cache_dir() is None
    assert "4 forced host devices" in host.cache_off_why()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert host.compilation_cache_dir() == str(tmp_path) and host.cache_off_why() == ""
    monkeypatch.delenv("XLA_FLAGS")
    assert host.forced_host_devices() == 1 and host.compilation_cache_dir() == str(tmp_path)


def _fake_pci(root, name: str, vendor: str, pci_class: str) -> None:
    device = root / "sys/bus/pci/devices" / name
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(pci_class + "\n")


def test_tpu_chips_are_found_from_local_files_only(tmp_path):
    """A GCE VM's Google NIC and disk are not TPUs; a Google accelerator, a TPU device file or
    a TPU variable is."""
    assert not host.has_tpu_chips(tmp_path, environ={})
    _fake_pci(tmp_path, "0000:00:03.0", "0x1af4", "0x020000")  # virtio NIC
    _fake_pci(tmp_path, "0000:00:04.0", "0x1ae0", "0x020000")  # gVNIC
    _fake_pci(tmp_path, "0000:00:05.0", "0x1ae0", "0x010802")  # Google NVMe disk
    (tmp_path / "dev/vfio").mkdir(parents=True)
    (tmp_path / "dev/vfio/vfio").write_text("")  # the VFIO control file: no device group
    assert not host.has_tpu_chips(tmp_path, environ={})
    assert host.host_platforms(tmp_path, environ={}) == "cpu"
    assert host.has_tpu_chips(tmp_path, environ={"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
    (tmp_path / "dev/vfio/0").write_text("")  # v5e and later
    assert host.has_tpu_chips(tmp_path, environ={})
    (tmp_path / "dev/vfio/0").unlink()
    (tmp_path / "dev/accel0").write_text("")  # v2-v4
    assert host.has_tpu_chips(tmp_path, environ={})
    (tmp_path / "dev/accel0").unlink()
    _fake_pci(tmp_path, "0000:00:06.0", "0x1ae0", "0x120000")
    assert host.has_tpu_chips(tmp_path, environ={})
    assert host.host_platforms(tmp_path, environ={}) is None


@pytest.mark.parametrize(
    "files, cuda_plugin, expected",
    [
        ((), True, "cpu"),
        (("dev/nvidiactl",), True, "cuda,cpu"),
        (("proc/driver/nvidia",), True, "cuda,cpu"),
        (("dev/nvidia0",), False, None),  # "cuda" without its plugin would stop the run
        (("dev/kfd",), True, None),  # AMD: JAX's discovery decides
    ],
)
def test_a_gpu_host_keeps_its_gpu(tmp_path, monkeypatch, files, cuda_plugin, expected):
    """Without TPU chips the TPU runtime is left out, never a GPU JAX could use."""
    monkeypatch.setattr(host, "_has_cuda_plugin", lambda: cuda_plugin)
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert host.host_platforms(tmp_path, environ={}) == expected


def test_the_users_jax_platforms_wins(tmp_path, monkeypatch):
    """JAX_PLATFORMS set, or jax_platforms already configured: left as it is."""
    monkeypatch.setenv("JAX_PLATFORMS", "")
    assert host.skip_absent_tpu(tmp_path) is None
    monkeypatch.delenv("JAX_PLATFORMS")
    assert jax.config.jax_platforms == "cpu"  # conftest's, read by jax at import
    assert host.skip_absent_tpu(tmp_path) is None
    assert jax.config.jax_platforms == "cpu"


def _no_terminal(cmd, env, cwd) -> subprocess.CompletedProcess:
    """``cmd`` as a batch job runs it: no terminal, stdin closed, JAX_PLATFORMS unset."""
    env = {k: v for k, v in env.items() if k != "JAX_PLATFORMS"}
    return subprocess.run(
        cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        start_new_session=True, timeout=120,
    )  # fmt: skip


needs_libtpu_without_chips = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or host.host_platforms() != "cpu",
    reason="needs libtpu installed on a host without TPU chips or GPUs",
)


@needs_libtpu_without_chips
def test_a_run_without_a_terminal_does_not_start_the_tpu_runtime(tmp_path, cli_env):
    """With libtpu installed and no chips, a batch job's stderr has none of libtpu's errors
    (host bounds, TPU_WORKER_HOSTNAMES) and the run is on the CPU."""
    args = ["--config", "tiny", "--config.steps=0", "--config.task.num_eval=0"]
    args += [f"--config.run_dir={tmp_path / 'run'}"]
    proc = _no_terminal([sys.executable, "-m", "jaxgrpo.train", *args], cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "devices  1 x cpu" in proc.stdout, proc.stdout
    assert "tpu" not in proc.stderr.lower(), proc.stderr[:2000]


@needs_libtpu_without_chips
def test_tpu_topologies_compile_with_the_tpu_runtime_left_out(tmp_path, cli_env):
    """`prepare_cli` keeps JAX to the CPU here, and libtpu still describes a TPU slice for
    ``jaxgrpo.planning.compile``."""
    code = (
        "from jaxgrpo.core.host import prepare_cli; prepare_cli(); import jax; "
        "from jaxgrpo.core import presets; from jaxgrpo.planning import aot; "
        "d = aot.topology_devices(presets.get_preset('v5e-8')); "
        "print(jax.config.jax_platforms, jax.default_backend(), len(d), d[0].platform)"
    )
    proc = _no_terminal([sys.executable, "-c", code], cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cpu", "cpu", "8", "tpu"], proc.stdout
