"""The training loop's plumbing: the data cursor, stop requests, where run files live, and
fault injection for the tests of a killed run.

Kept apart from ``train.py`` so the loop there reads as the sequence of steps it is; process
set-up is `jaxgrpo.core.host`, errors `jaxgrpo.core.errors`.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

FAULT_ENV = "JAXGRPO_FAULT"


def fault_point(name: str, step: int) -> None:
    """Kills this process (SIGKILL) at ``name`` of step ``step`` when ``$JAXGRPO_FAULT`` is
    ``name:step``: fault injection for the tests of what a killed run leaves behind."""
    if os.environ.get(FAULT_ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


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
