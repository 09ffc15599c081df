"""Process set-up of the CLIs (XLA flags, allocator, compilation cache) and the training loop's
plumbing: the data cursor, stop requests, and where run files live.

Kept apart from ``train.py`` so the loop there reads as the sequence of steps it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import tempfile
import traceback
from typing import Any

import numpy as np

# XLA:CPU hands dots, reductions and elementwise fusions to its YNNPACK library by default. Its
# dots are twice as fast as the fallback, but its reductions are slow at our shapes: a
# log-softmax over [1024, 49152] logits took 315 ms against 122 ms without them, and a GRPO
# step of the issue-5 benchmark 31 s against 23 s. Only CPU compilations read the flag.
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


class UserError(Exception):
    """An error the code understood, whose message names what is wrong (a config key, a file, a
    data row, a reward function, a missing package): the CLIs print it as one line."""


ERROR_LOG = os.path.join(tempfile.gettempdir(), "jaxgrpo-last-error.log")


@contextlib.contextmanager
def one_line_errors():
    """Turns a ``UserError`` or ``OSError`` raised inside into ``error: <message>`` and exit
    status 1; the traceback goes to ``ERROR_LOG`` (the line names it) for whoever needs it."""
    try:
        yield
    except (UserError, OSError) as e:
        with open(ERROR_LOG, "w", encoding="utf-8") as f:
            traceback.print_exc(file=f)
        sys.exit(f"error: {e} (traceback: {ERROR_LOG})")


FAULT_ENV = "JAXGRPO_FAULT"


def fault_point(name: str, step: int) -> None:
    """Kills this process (SIGKILL) at ``name`` of step ``step`` when ``$JAXGRPO_FAULT`` is
    ``name:step``: fault injection for the tests of what a killed run leaves behind."""
    if os.environ.get(FAULT_ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class MissingExtra(UserError, ImportError):
    """An optional package is missing; the message names the ``pip install`` that brings it."""

    def __init__(self, package: str, extra: str, needed_for: str):
        super().__init__(
            f'{needed_for} needs the {package!r} package: pip install "jaxgrpo[{extra}]"'
        )


def require(module: str, extra: str, needed_for: str) -> Any:
    """Imports optional ``module`` or raises ``MissingExtra`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra, needed_for) from None


CACHE_ENV = "JAXGRPO_CACHE_DIR"


def compilation_cache_dir() -> str | None:
    """Where compiled programs are cached: ``$JAXGRPO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jaxgrpo/xla`` (``~/.cache/jaxgrpo/xla``); None when set to ``off``."""
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
      The cache directory, or None when the cache is off (``JAXGRPO_CACHE_DIR=off``).
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
    starts its backend and threads), quiet third-party advice, the compilation cache."""
    use_cpu_xla_flags()
    keep_freed_memory()
    quiet_libraries()
    enable_compilation_cache()


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
    page-faults its whole working set in again. On the 2-core benchmark machine that was about
    630k faults and 8-11 s of system time in each 11-14 s full fine-tuning update; with this
    call there are none and the update takes 7.6-8.9 s (`benchmarks/README.md`). The cost is
    that the process keeps its peak heap instead of shrinking between steps.

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
    return all(mallopt(param, value) == 1 for param, value in settings)


class DataStream:
    """Training examples in a fixed order: epoch e is ``task.train_examples(seed + e)``.

    ``position`` counts examples consumed; it is the data cursor stored in checkpoints, so a
    resumed run sees exactly the examples an uninterrupted one would have.
    """

    def __init__(self, task: Any, seed: int, position: int = 0):
        self.task, self.seed, self.position = task, seed, position
        self._epoch, self._examples = -1, []
        self.size = len(self._epoch_examples(0))  # examples per epoch

    def _epoch_examples(self, epoch: int) -> list:
        if epoch != self._epoch:
            self._examples = list(self.task.train_examples(self.seed + epoch))
            if not self._examples:
                raise ValueError(f"task {self.task.name!r} has no training examples")
            self._epoch = epoch
        return self._examples

    def take(self, n: int) -> list:
        """The next ``n`` examples, crossing epoch boundaries as needed."""
        out = []
        while len(out) < n:
            epoch, offset = divmod(self.position, self.size)
            chunk = self._epoch_examples(epoch)[offset : offset + n - len(out)]
            out.extend(chunk)
            self.position += len(chunk)
        return out


class StopRequest:
    """SIGTERM / first SIGINT set ``requested``; the loop stops after the current step."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nsignal {signum}: stopping after this step (Ctrl-C again to abort)", flush=True)

    def agreed(self) -> bool:
        """True when any process was asked to stop: all processes leave the loop together.

        A host that stopped alone would leave the others blocked in the next step's collectives.
        """
        import jax

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
        return bool(np.any(flags))

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class RunFiles:
    """Where the run's text files live, for a local or a remote (``gs://...``) ``run_dir``.

    Checkpoints go straight to ``run_dir`` (orbax writes to object stores). Metrics, samples,
    the config snapshot and TensorBoard events are appended line by line, which object stores
    cannot do, so for a remote ``run_dir`` they are written under ``./runs/<name>`` and copied
    to ``run_dir`` after each checkpoint and at exit (and copied back when a run resumes on a
    fresh machine).
    """

    NAMES = ("metrics.jsonl", "samples.jsonl", "config.json")

    def __init__(self, run_dir: str, process: int):
        self.run_dir, self.process = run_dir, process
        self.remote = "://" in run_dir
        name = os.path.basename(run_dir.rstrip("/"))
        self.local_dir = os.path.join("runs", name) if self.remote else run_dir
        if process == 0:
            os.makedirs(self.local_dir, exist_ok=True)
            if self.remote:
                self._copy(self.run_dir, self.local_dir, only_missing=True)

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts) if "://" in parts[0] else os.path.join(*parts)

    def _copy(self, src: str, dst: str, only_missing: bool = False) -> None:
        from etils import epath

        for name in self.NAMES:
            source, target = epath.Path(src) / name, epath.Path(dst) / name
            if source.exists() and not (only_missing and target.exists()):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())

    def upload(self) -> None:
        """Copies the text files to a remote ``run_dir`` (process 0; no-op when local)."""
        if self.remote and self.process == 0:
            self._copy(self.local_dir, self.run_dir)
