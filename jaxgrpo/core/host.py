"""Process set-up: XLA flags, the allocator, the JAX platforms, the compilation cache, quiet
third-party libraries and JAX's multi-process runtime, done by every CLI first thing
(`prepare_cli`).

Nothing here imports jax at module level: the flags and the allocator must be set before JAX
starts its backend and threads.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Mapping

# XLA:CPU hands dots, reductions and elementwise fusions to its YNNPACK library by default;
# its dots are fast but its reductions slow at our shapes, so only dots go to it (figures in
# benchmarks/README.md, "XLA:CPU flags: dots to YNNPACK, reductions off it"). Only CPU
# compilations read the flag.
CPU_XLA_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=individual_dot",)


def use_cpu_xla_flags() -> None:
    """Adds `CPU_XLA_FLAGS` to the XLA_FLAGS environment variable, unless the user set them.

    Call it before JAX creates its backends (the CLIs do it first thing in ``main``); later
    calls change nothing for the running process.
    """
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in current]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()


CACHE_ENV = "JAXGRPO_CACHE_DIR"


# The XLA flag that splits the host CPU into N virtual devices (tests, sharding demos, compile
# checks of CPU meshes).
FORCE_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
    """Asks XLA:CPU for ``n`` virtual devices; call it before JAX creates its backends."""
    current = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{current} {FORCE_HOST_DEVICES_FLAG}={int(n)}".strip()


def forced_host_devices() -> int:
    """The CPU devices ``XLA_FLAGS`` forces (`FORCE_HOST_DEVICES_FLAG`; 1 when absent)."""
    found = re.findall(rf"{FORCE_HOST_DEVICES_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def cache_off_why() -> str:
    """Why `compilation_cache_dir` turned the cache off by itself (" (...)"), or ""."""
    devices = forced_host_devices()
    if devices == 1:
        return ""
    return f" ({devices} forced host devices: their collectives deadlock on cached programs)"


def compilation_cache_dir() -> str | None:
    """Where compiled programs are cached: ``$JAXGRPO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jaxgrpo/xla`` (``~/.cache/jaxgrpo/xla``); None when set to ``off``, and
    None with several forced host devices: there XLA:CPU's in-process collectives deadlocked
    on sharded programs read back from the cache (a rendezvous timeout aborts the process),
    where the same programs compiled afresh ran."""
    if cache_off_why():
        return None
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxgrpo", "xla")


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in ``compilation_cache_dir()``.

    A program compiled once (same shapes, flags, devices and jax version) is then read from
    disk by every later run instead of being compiled again, so a rerun of a config starts
    training within seconds. Every program is cached, however fast it compiled.

    Returns:
      The cache directory, or None when the cache is off (``JAXGRPO_CACHE_DIR=off``, or
      several forced host devices).
    """
    import jax

    path = compilation_cache_dir()
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def prepare_cli() -> None:
    """The process set-up every CLI does first: XLA:CPU flags and the allocator (before JAX
    starts its backend and threads), no TPU runtime on a host without TPU chips, quiet
    third-party advice, the compilation cache."""
    use_cpu_xla_flags()
    keep_freed_memory()
    skip_absent_tpu()
    quiet_libraries()
    enable_compilation_cache()


# Local signs of TPU chips: the device files libtpu opens (accelN on TPU v2-v4, VFIO groups on
# v5e and later) and the variables a TPU VM or GKE sets, or a user sets to ask for a TPU.
TPU_DEVICE_GLOBS = ("dev/accel[0-9]*", "dev/vfio/[0-9]*")
TPU_ENV = (
    "JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS"
)  # fmt: skip
GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI class prefixes of Google's devices that are not TPUs: storage (NVMe) and network (gVNIC),
# present on every GCE VM.
NOT_TPU_PCI_CLASSES = ("0x01", "0x02")
# Signs of an NVIDIA GPU (the files JAX checks, and the driver's /proc entry) or an AMD one.
NVIDIA_GPU_FILES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "proc/driver/nvidia")
AMD_GPU_FILES = ("dev/kfd",)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def has_tpu_chips(root: str = "/", environ: Mapping[str, str] | None = None) -> bool:
    """Whether this host may have TPU chips, from local files and variables only (no metadata
    server): a TPU variable, a TPU device file, or a Google PCI device that is not a disk or
    a NIC. When unsure it says yes, which leaves JAX's own discovery in place."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in TPU_ENV):
        return True
    if any(glob.glob(os.path.join(root, pattern)) for pattern in TPU_DEVICE_GLOBS):
        return True
    for device in glob.glob(os.path.join(root, "sys/bus/pci/devices/*")):
        if _read(os.path.join(device, "vendor")) == GOOGLE_PCI_VENDOR:
            if not _read(os.path.join(device, "class")).startswith(NOT_TPU_PCI_CLASSES):
                return True
    return False


def _has_cuda_plugin() -> bool:
    """Whether JAX's CUDA plugin is installed (``jax_plugins.xla_cuda12``, ``xla_cuda13``)."""
    spec = importlib.util.find_spec("jax_plugins")
    places = spec.submodule_search_locations if spec else None
    return any(glob.glob(os.path.join(place, "xla_cuda*")) for place in places or ())


def host_platforms(root: str = "/", environ: Mapping[str, str] | None = None) -> str | None:
    """The JAX platforms for this host, or None to leave the choice to JAX's discovery.

    None where TPU chips may be present, or a GPU without JAX's CUDA plugin (naming "cuda"
    would then stop the run; JAX's discovery says which plugin to install). "cuda,cpu" with an
    NVIDIA GPU and the plugin: what JAX picks there anyway, less the TPU runtime. Else "cpu".
    """
    if has_tpu_chips(root, environ):
        return None
    nvidia = any(os.path.exists(os.path.join(root, f)) for f in NVIDIA_GPU_FILES)
    if nvidia and _has_cuda_plugin():
        return "cuda,cpu"
    if nvidia or any(os.path.exists(os.path.join(root, f)) for f in AMD_GPU_FILES):
        return None
    return "cpu"


def skip_absent_tpu(root: str = "/") -> str | None:
    """Keeps JAX from starting the TPU runtime on a host without TPU chips.

    With libtpu installed (the ``tpu`` extra), JAX starts it whether or not the host has
    chips, and without chips it prints errors (host bounds, ``TPU_WORKER_HOSTNAMES``) that
    read as a failed run. This sets ``jax_platforms`` to `host_platforms`, unless the user set
    JAX_PLATFORMS (or ``jax_platforms``), which always wins. Call it before JAX's first
    backend use: the CLIs' modules import jax, which reads JAX_PLATFORMS only then, so this
    sets JAX's config, not the variable. Compiling for TPU topologies
    (``jaxgrpo.planning.compile``) loads libtpu by itself and needs no TPU backend.

    Returns:
      The platforms set, or None when JAX's choice was left alone.
    """
    import jax  # here, not at the top: the allocator must be set before jax is imported

    if "JAX_PLATFORMS" in os.environ or jax.config.jax_platforms is not None:
        return None
    platforms = host_platforms(root)
    if platforms:
        jax.config.update("jax_platforms", platforms)
    return platforms


def quiet_libraries() -> None:
    """Silences advice that is noise for a jaxgrpo user (transformers' "PyTorch was not found":
    jaxgrpo uses only its tokenizers). Call it before transformers is imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


# glibc `mallopt` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep the memory XLA:CPU frees, for the program's next run to reuse.

    XLA:CPU allocates its temporary and output buffers with malloc at every execution and frees
    them after it. glibc serves the large ones with `mmap` (always, from worker threads, whose
    arenas hold at most 64 MB) and returns them to the kernel on free, so every execution
    page-faults its whole working set in again (the system time this costs is measured in
    `benchmarks/README.md`, "Keeping freed memory"). The cost is that the process keeps its
    peak heap, until `release_freed_memory` hands the free part back; that also runs after
    every compilation, so the compiler's working memory does not stay under the new program's
    first run.

    It sets one malloc arena for all threads, no `mmap` allocations, and no trimming of the
    heap. Call it first thing, before JAX (or torch) starts threads: an arena a thread already
    has stays in use. The CLIs and benchmarks call it; set JAXGRPO_SYSTEM_MALLOC=1 to skip it.

    Returns:
        True if the settings were applied (Linux with glibc), else False.
    """
    if os.environ.get("JAXGRPO_SYSTEM_MALLOC") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1 is SIZE_MAX to glibc's size_t threshold: never trim.
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    global _keeping
    _keeping = all(mallopt(param, value) == 1 for param, value in settings)
    if _keeping:
        _release_after_compiles()
    return _keeping


# The `jax.monitoring` duration event XLA emits when it finishes compiling a program.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _release_after_compiles() -> None:
    """Trims the heap each time XLA finishes compiling a program (registered once)."""
    from jax import monitoring

    global _listening
    if _listening:
        return
    _listening = True

    def listener(event: str, duration: float, **_) -> None:
        del duration
        if event == BACKEND_COMPILE_EVENT:
            release_freed_memory()

    monitoring.register_event_duration_secs_listener(listener)


_keeping = False  # keep_freed_memory() is in effect
_listening = False  # _release_after_compiles() has registered its listener


def release_freed_memory() -> bool:
    """Hands the freed pages of the heap `keep_freed_memory` keeps back to the kernel
    (glibc's `malloc_trim`); does nothing without it.

    The kept heap only grows: what one program freed stays resident, and where the next
    program's buffers do not fit its holes the heap grows past them, so a step's peak becomes
    more than its largest phase. The learner calls this between the phases of a step (sampling,
    scoring, update): each phase faults its working set in once per step (about 70 ms per GiB
    here), and the repeated executions within a phase still reuse it (benchmarks/README.md,
    "Trimming the heap between phases").

    Returns:
        True if the heap was trimmed.
    """
    if not _keeping:
        return False
    ctypes.CDLL(None).malloc_trim(0)
    return True


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts JAX's multi-controller runtime when more than one process is requested.

    Arguments default to the env vars JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID. With a single process (the default) this is a no-op. On TPU pods, pass
    num_processes=-1 to let JAX discover the topology itself.

    Returns:
        True if `jax.distributed.initialize` was called.
    """
    import jax  # here, not at the top: the other set-up must run before jax is imported

    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes == -1:
        jax.distributed.initialize()
        return True
    if not num_processes or num_processes <= 1:
        return False
    logging.getLogger(__name__).info(
        "jax.distributed.initialize(%s, %d, %s)", coordinator, num_processes, process_id
    )
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True
