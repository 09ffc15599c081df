"""``rewards.limits``: a call past its time or memory limit is interrupted on the main thread
(the signal it borrows still reaches whoever handled it before) and on any other, as the
producer thread of asynchronous rollouts scores rewards: through the learner's scoring path, a
call that spins, sleeps, raises or hoards memory fails there exactly as on the main thread, and
the thread goes on with no stray interrupt."""

import concurrent.futures
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from jaxgrpo.rewards import RewardSet
from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded, bounded_call
from jaxgrpo.rl import rollout as ro


def test_a_sleep_past_the_limit_is_interrupted_within_the_watchdogs_latency():
    t0 = time.perf_counter()
    with pytest.raises(RewardLimitExceeded, match=r"longer than 0\.3 s"):
        with bounded(0.3):
            time.sleep(30)
    assert time.perf_counter() - t0 < 2.0


def test_memory_growth_past_the_limit_is_interrupted():
    hoard = []
    with pytest.raises(RewardLimitExceeded, match="GiB"):
        with bounded(30.0, max_memory_gb=0.25):
            while True:
                hoard.append(b"x" * (8 << 20))
    assert len(hoard) * 8 < 1024, "stopped near the limit, not after a GiB"


def test_a_call_within_its_limits_returns_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with bounded(5.0, max_memory_gb=1.0):
        value = sum(range(1000))
    assert value == 499500 and signal.getsignal(signal.SIGUSR1) is before


def test_a_foreign_signal_reaches_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with bounded(5.0):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _on_a_worker(fn, *args):
    """``fn(*args)`` run on a worker thread (not the main one), its value or exception."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=60)


def _busy(seconds: float) -> int:
    """Python bytecodes for ``seconds`` (where a stray interrupt would land); their count."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
    return n


def test_off_the_main_thread_a_python_loop_is_interrupted_and_the_thread_goes_on():
    """The watchdog raises in the worker itself; after the stopped call, nothing it sent lands
    (past its resend interval), and a call within its limits returns."""

    def work():
        t0 = time.perf_counter()
        with pytest.raises(RewardLimitExceeded, match=r"longer than 0\.3 s \(rewards\.timeout_s\)"):
            with bounded(0.3):
                while True:
                    pass
        stopped_after = time.perf_counter() - t0
        assert _busy(1.2) > 0, "no stray interrupt after the call"
        with bounded(5.0):
            value = sum(range(1000))
        return stopped_after, value

    stopped_after, value = _on_a_worker(work)
    assert stopped_after < 1.0 and value == 499500


def test_off_the_main_thread_a_call_that_swallows_the_interrupt_gets_it_again():
    def work():
        swallowed = 0
        with pytest.raises(RewardLimitExceeded):
            with bounded(0.2):
                while True:
                    try:
                        while True:
                            pass
                    except RewardLimitExceeded:
                        swallowed += 1
                        if swallowed > 1:
                            raise
        return swallowed

    assert _on_a_worker(work) == 2


def test_off_the_main_thread_memory_growth_past_the_limit_is_interrupted():
    def work():
        hoard = []
        with pytest.raises(RewardLimitExceeded, match=r"GiB \(rewards\.max_memory_gb\)"):
            with bounded(30.0, max_memory_gb=0.25):
                while True:
                    hoard.append(b"x" * (8 << 20))
        return len(hoard)

    assert _on_a_worker(work) * 8 < 1024, "stopped near the limit, not after a GiB"


def test_bounded_call_leaves_a_call_blocked_in_c_code_behind_at_its_limit():
    """A sleep takes no asynchronous exception until it returns: off the main thread the
    caller stops waiting for it at the limit (plus a grace), and it ends when it wakes."""
    ended = threading.Event()

    def naps():
        try:
            time.sleep(1.5)
        finally:
            ended.set()
        return "awake"

    t0 = time.perf_counter()
    with pytest.raises(RewardLimitExceeded, match=r"longer than 0\.3 s"):
        _on_a_worker(bounded_call, naps, 0.3)
    assert time.perf_counter() - t0 < 1.3 and not ended.is_set()
    assert ended.wait(5.0), "the call left behind ends when it wakes"
    assert _on_a_worker(bounded_call, lambda: "fine", 0.3) == "fine"
    with pytest.raises(KeyError, match="what fn raised"):
        _on_a_worker(bounded_call, lambda: {}["what fn raised"], 0.3)


def _spins(prompts, completions, **_):
    while True:
        pass


def _sleeps(prompts, completions, **_):
    time.sleep(10)


def _raises(prompts, completions, **_):
    raise ValueError("cannot score")


def _hoards(prompts, completions, **_):
    hoard = []
    while True:
        hoard.append(b"x" * (8 << 20))


def _length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


EXAMPLES = [{"messages": [{"role": "user", "content": "Half of 1?"}], "answer": "1/2"}]
COMPLETIONS = ["<answer>1/2</answer>", "<answer>1/3</answer>"]
SAMPLED = {"tokens": np.ones((2, 3), np.int32), "mask": np.ones((2, 3), np.int32)}


def _score(reward_set: RewardSet, examples=EXAMPLES) -> tuple:
    """The learner's scoring of one example's two completions (``rl.rollout.score``)."""
    prompts = ["Half of 1?"] * 2
    return ro.score(reward_set, "math", examples, prompts, COMPLETIONS, 2, 0, sampled=SAMPLED)


@pytest.mark.parametrize("where", ["main", "worker"])
def test_calls_past_their_limits_or_raising_score_as_failed_on_any_thread(where, caplog):
    """The same scoring, on the main thread and on a worker: a function that spins, sleeps or
    hoards memory is stopped at its limit, one that raises has its error counted; each scores
    None (NaN) with its samples counted as errors, and the others score as usual. The worker
    then scores a normal batch correctly."""
    specs = [(fn, 1.0) for fn in (_spins, _sleeps, _raises, _hoards, _length)]
    rewards = RewardSet(specs, timeout_s=0.5, max_memory_gb=0.25)

    def work():
        t0 = time.perf_counter()
        total, per_fn, _, _ = _score(rewards)
        took = time.perf_counter() - t0
        _busy(1.2)  # where a stray interrupt of the worker would land
        again = RewardSet([(_length, 1.0)], timeout_s=0.5)
        return took, total, per_fn, _score(again)[0]

    with caplog.at_level(logging.WARNING, logger="jaxgrpo.rewards.combine"):
        took, total, per_fn, later = work() if where == "main" else _on_a_worker(work)
    assert took < 4.0, "each stopped near its limit"
    for name in ("_spins", "_sleeps", "_raises", "_hoards"):
        assert np.isnan(per_fn[name]).all(), name
    np.testing.assert_array_equal(per_fn["_length"], np.float32([20, 20]))
    np.testing.assert_array_equal(total, np.float32([20, 20]))
    assert rewards.error_counts == {"_spins": 2, "_sleeps": 2, "_raises": 2, "_hoards": 2}
    logged = caplog.text
    assert "'_spins' took longer than 0.5 s (rewards.timeout_s)" in logged
    assert "'_sleeps' took longer than 0.5 s (rewards.timeout_s)" in logged
    assert "'_hoards' grew the process's memory by more than 0.25 GiB" in logged
    assert "'_raises' raised on 2 of 2 samples" in logged and "cannot score" in logged
    np.testing.assert_array_equal(later, np.float32([20, 20]))


def test_math_verify_grading_on_a_worker_thread():
    """``exact_answer`` on a math task (``verifier`` math_verify) scores as on the main thread:
    math-verify's signal-based timeouts run in its worker process off the main thread."""
    examples = [{**EXAMPLES[0], "answer": "\\frac{2}{4}", "verifier": "math_verify"}]
    rewards = RewardSet([("exact_answer", 1.0)])
    total, per_fn, _, correct = _on_a_worker(_score, rewards, examples)
    np.testing.assert_array_equal(per_fn["exact_answer"], np.float32([1, 0]))
    assert correct.tolist() == [True, False] and rewards.error_counts == {}
