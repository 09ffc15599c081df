"""``rewards.limits.bounded``: a call past its time or memory limit is interrupted on the main
thread, and the signal it borrows still reaches whoever handled it before."""

import os
import signal
import threading
import time

import pytest

from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded


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


def test_off_the_main_thread_the_call_runs_unbounded():
    """Only the main thread can be interrupted by a signal handler; elsewhere the call runs
    to its end rather than fail."""
    done = []

    def work():
        with bounded(0.1):
            time.sleep(0.4)
        done.append(True)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done == [True]
