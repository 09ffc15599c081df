"""Asynchronous rollouts: a sampler thread runs up to ``rl.max_staleness`` policy versions ahead
of the learner.

Version v is the policy after v updates (version 0: the initial weights); the synchronous loop
trains step s on a batch sampled by version s. Here a thread of its own (the producer) samples
batch s, runs its tools and scores its rewards while the main thread trains on earlier ones.
With k = ``rl.max_staleness`` and ``rl.stale_batches``:

- ``"wait"`` (default): batch s is sampled by version max(0, s - k); the producer waits for
  those weights. Which version samples which batch is fixed, so the run is reproducible, and a
  resumed one exact.
- ``"drop"``: the producer samples every batch with the newest version it holds and never
  waits for weights; the learner drops a batch more than k versions old (``async/dropped``)
  and takes the next, whose examples are new ones. Faster where production times vary, not
  reproducible bit for bit.

The producer holds at most k + 1 finished batches. The loss corrects for the lag with the
sampler's log-probs as the behaviour policy (``rl.lag_correction``, ``jaxgrpo.rl.losses``).
Host work (tools, reward functions under their limits, ``jaxgrpo.rewards.limits``) runs on
the producer thread, so it overlaps the learner's device work. After every update the learner
publishes its new trainable params to the sampler's devices (``SamplerSide.place``).

Each step's metrics: ``async/lag_mean`` and ``async/lag_max`` (learner version minus the
version that drew each trained id), ``async/learner_wait_s`` (the learner waiting for the
batch), ``async/sampler_wait_s`` (the producer waiting for the batch's weights),
``async/dropped``, ``time/weight_transfer`` (publishing the weights) and
``async/overlap/<phase>``: seconds of the batch's sampling and reward phases that ran while
the learner was busy.

Resume: a checkpoint after step c stores the versions batches c .. c+k-1 are sampled with
(``held_versions``) and the data cursor before batch c (``cursor``); the resumed producer
samples them again from the same keys and examples, so nothing is trained twice or lost.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxgrpo.core import sharding
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.rl.learner import Collected, Learner
from jaxgrpo.rl.run_log import warn_once

_POLL_S = 0.1  # how often a wait looks at whether the other side stopped


class PipelineClosed(Exception):
    """The pipeline was closed while its producer waited."""


class SamplerWeights:
    """The trainable params' versions as the sampler holds them, published by the learner."""

    def __init__(self, place):
        self._place = place
        self._versions: dict[int, Any] = {}
        self._cond = threading.Condition()
        self.closed = False

    def publish(self, version: int, params) -> float:
        """Places ``params`` as version ``version`` on the sampler's side; returns the seconds
        the transfer took (waited for, so that it is measured, not just dispatched)."""
        t0 = time.perf_counter()
        placed = jax.block_until_ready(self._place(params))
        with self._cond:
            self._versions[version] = placed
            self._cond.notify_all()
        return time.perf_counter() - t0

    def wait(self, version: int) -> Any:
        """Version ``version``'s params, waiting until they are published."""
        with self._cond:
            while version not in self._versions:
                if self.closed:
                    raise PipelineClosed
                self._cond.wait(_POLL_S)
            return self._versions[version]

    def newest(self) -> tuple[int, Any]:
        """(version, params) of the newest version published."""
        with self._cond:
            version = max(self._versions)
            return version, self._versions[version]

    def forget_below(self, version: int) -> None:
        """Drops the versions older than ``version`` (no batch will be sampled with them)."""
        with self._cond:
            for v in [v for v in self._versions if v < version]:
                del self._versions[v]

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class _Failed:
    """An exception the producer raised, for the learner to raise where it waits."""

    def __init__(self, step: int, error: BaseException):
        self.step, self.error = step, error


class RolloutPipeline:
    """Batches for steps ``start .. steps - 1`` from a producer thread, k versions ahead.

    Args:
        learner: the run's `Learner` (its ``collect_batch`` is the producer's work, its
            ``train`` the learner's).
        data: the run's ``DataStream``, positioned before batch ``start``'s examples; only the
            producer reads it from here on.
        state: the learner's state at ``start`` (its step and key start the producer's key
            chain, the learner's own copy of the same chain).
        start / steps: the first batch and the end of the run.
        held: version -> trainable params that in-flight batches are sampled with, from a
            checkpoint (``held_versions``); the state's params are version ``start``.
    """

    def __init__(self, learner: Learner, data, state, start: int, steps: int, held=None):
        if jax.process_count() > 1:
            raise ConfigError(
                f"config key 'rl.max_staleness' = {learner.rl.max_staleness}: asynchronous "
                f"rollouts run in one process, this run has {jax.process_count()} (the "
                "sampler's and the learner's threads would issue collectives in different "
                "orders on different hosts); set rl.max_staleness=0"
            )
        self.learner, self.data, self.start, self.steps = learner, data, start, steps
        rl = learner.rl
        self.k, self.drop = rl.max_staleness, rl.stale_batches == "drop"
        self.weights = SamplerWeights(learner.sampler_side.place)
        held = dict(held or {})
        missing = [v for v in range(max(0, start - self.k), start) if v not in held]
        if missing and not self.drop:
            # A checkpoint of a synchronous run, or of one with a smaller lag: its in-flight
            # batches are sampled with the checkpoint's own weights (lag 0).
            warn_once(
                "pipeline/missing-versions",
                f"the checkpoint holds no weights of policy versions {missing}; batches "
                f"{start}..{start + len(missing) - 1} are sampled with step {start}'s",
            )
            held.update({v: state.params for v in missing})
        for version, params in sorted(held.items()):
            if version < start:
                self.weights.publish(version, params)
        self.transfer_s = self.weights.publish(start, state.params)
        self._next = start  # the producer's index of the next batch the learner trains
        # The producer's copy of the learner's key chain (advance is pure: same keys).
        self._chain = learner.programs.advance(state.step, state.rng)
        self._queue: queue.Queue = queue.Queue(maxsize=self.k + 1)
        self._cursors: dict[int, int] = {}
        self._cursor_cond = threading.Condition()
        self._stop = threading.Event()
        self._busy: collections.deque = collections.deque(maxlen=4 * (self.k + 2))
        self.dropped = 0
        self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------
    # The producer thread.

    def _produce(self) -> None:
        s = self.start
        try:
            _, rng, key, _ = self._chain
            step = self._chain[0]
            b = self.learner.rl.prompts_per_step
            # Dropping goes on past the run's last step: the learner may need more batches.
            while (s < self.steps or self.drop) and not self._stop.is_set():
                t0 = time.perf_counter()
                if self.drop:
                    version, params = self.weights.newest()
                else:
                    version = max(0, s - self.k)
                    params = self.weights.wait(version)
                waited = time.perf_counter() - t0
                self._set_cursor(s, self.data.position)
                examples = self.data.take(b)
                # (the step that sets a batch's temperature and curricula: its own index,
                # the last step's for the batches a dropping run samples past it)
                at = min(s, self.steps - 1)
                batch = self.learner.collect_batch(
                    params, examples, key, at, draw=self.data.take, version=version
                )
                batch.index = s
                batch.sampler_wait_s = waited
                self._put(batch)
                s += 1
                if s < self.steps or self.drop:
                    step, rng, key, _ = self.learner.programs.advance(step, rng)
            self._set_cursor(s, self.data.position)
        except PipelineClosed:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the learner to raise
            self._put(_Failed(s, error))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=_POLL_S)
                return

    def _set_cursor(self, step: int, position: int) -> None:
        with self._cursor_cond:
            self._cursors[step] = position
            self._cursor_cond.notify_all()

    # ------------------------------------------------------------------------------------------
    # The learner's side (the main thread).

    def train_step(self, state) -> tuple[Any, dict[str, float], list[dict]]:
        """One training step on the next batch, then its weights published to the sampler:
        ``Learner.step``'s contract, with the pipeline's metrics."""
        learner = self.learner
        step = int(sharding.to_host(state.step))
        state = learner._maybe_reset_reference(state, step)
        next_step, next_rng, _, k_shuffle = learner.programs.advance(state.step, state.rng)
        batch, metrics = self.next_batch(step)
        with self.learner_busy():
            advanced = (next_step, next_rng, k_shuffle)
            state, step_metrics, samples = learner.train(state, batch, advanced)
            transfer = self.publish(step + 1, state.params)
        return state, {**step_metrics, **metrics, "time/weight_transfer": transfer}, samples

    def next_batch(self, step: int) -> tuple[Collected, dict[str, float]]:
        """The batch for training step ``step`` and the pipeline's metrics of it.

        Raises:
            the producer's exception, with a note naming the step it was producing.
        """
        t0 = time.perf_counter()
        while True:
            item = self._get()
            if isinstance(item, _Failed):
                item.error.add_note(f"(raised on the rollout thread, sampling step {item.step})")
                raise item.error
            self._next = item.index + 1
            if self.drop and step - item.version > self.k:
                self.dropped += 1
                continue
            break
        waited = time.perf_counter() - t0
        return item, self._metrics(item, step, waited)

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the rollout thread ended without a batch") from None

    def _metrics(self, batch: Collected, step: int, waited: float) -> dict[str, float]:
        versions = batch.rollout.versions
        lag = step - versions[versions >= 0] if versions is not None else np.zeros(1)
        lag = lag if lag.size else np.asarray([step - batch.version])
        metrics = {
            "async/lag_mean": float(lag.mean()),
            "async/lag_max": float(lag.max()),
            "async/learner_wait_s": waited,
            "async/sampler_wait_s": batch.sampler_wait_s,
            "async/dropped": float(self.dropped),
        }
        for phase in ("sampling", "rewards"):
            spans = batch.timer.spans.get(phase, [])
            metrics[f"async/overlap/{phase}"] = _overlap(spans, list(self._busy))
        return metrics

    @contextlib.contextmanager
    def learner_busy(self):
        """Marks the learner's work of a step, against which the producer's phases overlap."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._busy.append((t0, time.perf_counter()))

    def publish(self, version: int, params) -> float:
        """The learner's params after ``version`` updates, to the sampler; seconds taken."""
        seconds = self.weights.publish(version, params)
        oldest = version - self.k if not self.drop else version
        self.weights.forget_below(max(0, oldest))
        return seconds

    def cursor(self) -> int:
        """The data position before the examples of the next batch the learner trains
        (waits for the producer to start it): a checkpoint's data cursor."""
        step = self._next
        with self._cursor_cond:
            while step not in self._cursors:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout thread stopped before batch {step}")
                self._cursor_cond.wait(_POLL_S)
            return self._cursors[step]

    def held_versions(self, step: int) -> dict[int, Any]:
        """version -> params of the batches in flight after step ``step`` (checkpoints)."""
        if self.drop:
            return {}
        wanted = range(max(0, step - self.k), step)
        return {v: self.weights.wait(v) for v in wanted}

    def close(self) -> None:
        """Stops the producer (after the batch it is sampling) and drops what is queued."""
        self._stop.set()
        self.weights.close()
        while not self._queue.empty():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()
        self._thread.join(timeout=60)


def _overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Seconds of ``spans`` that fall inside ``busy`` (each a list of disjoint intervals)."""
    return float(sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in busy))
