"""Episodes split over processes (``RowShare``): each row's environment is created and reset,
and its calls run, on its owner only; every process then holds the same episodes, results and
environments as one process running them all. Two processes are simulated by two threads with
a barrier for the gather, then run for real through ``jax.distributed`` (gloo)."""

import json
import os
import socket
import subprocess
import sys
import threading

import episode_worker as ew
import pytest

from jaxgrpo.agents.share import RowShare
from jaxgrpo.core.errors import UserError
from jaxgrpo.models.tiny import tiny_tokenizer

N_ROWS = len(ew.EXAMPLES) * ew.GROUP  # 6: rows 0-2 on process 0, 3-5 on process 1


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(autouse=True)
def fresh_logs():
    ew.CALLS.clear()
    ew.RESETS.clear()


def threaded(n: int, fn):
    """``fn(share)`` on ``n`` threads named t0.., each a "process" of ``n`` whose gather meets
    the others' at a barrier; returns each one's value or exception."""
    barrier, slots, out = threading.Barrier(n, timeout=60), [None] * n, [None] * n

    def gather_for(i):
        def gather(blob):
            slots[i] = blob
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got

        return gather

    def body(i):
        try:
            out[i] = fn(RowShare(i, n, gather_for(i)))
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=body, args=(i,), name=f"t{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_rows_split_into_contiguous_blocks():
    owners = [RowShare(0, 2).owner(r, 6) for r in range(6)]
    assert owners == [0, 0, 0, 1, 1, 1]
    assert [RowShare(0, 4).owner(r, 6) for r in range(6)] == [0, 0, 1, 2, 2, 3]


def test_each_row_runs_on_its_owner_and_every_process_sees_one_processs_episodes(tok):
    one = ew.summary(*ew.run(RowShare(), tok=tok))
    assert sorted(one["calls"]) == [("MainThread", f"{r}*2") for r in (0, 2, 4)]
    ew.CALLS.clear()
    ew.RESETS.clear()
    two = [ew.summary(*got) for got in threaded(2, lambda share: ew.run(share, tok=tok))]
    for seen in two:
        for key in ("chats", "tokens", "model_mask", "results"):
            assert seen[key] == one[key], key
        assert [[text for text, _ in e] for e in seen["entries"]] == [
            [text for text, _ in e] for e in one["entries"]
        ]
        # Each row's environment is its owner's, sent to the other process after the episode.
        assert [{w for _, w in e} for e in seen["entries"]] == [{"t0"}] * 3 + [{"t1"}] * 3
    assert sorted(ew.CALLS) == [("t0", "0*2"), ("t0", "2*2"), ("t1", "4*2")], "once, by owner"
    assert sorted(ew.RESETS) == ["t0"] * 3 + ["t1"] * 3
    assert one["results"][0] == ["noted r0", "0"] and one["results"][1] == ["noted r1"]


class Boom(ew.Ledger):
    def reset(self, answer, **kwargs):
        if answer == "5":
            raise ValueError("no five")
        return super().reset(answer, **kwargs)


class Locked(ew.Ledger):
    def reset(self, answer, **kwargs):
        self.lock = threading.Lock()
        return super().reset(answer, **kwargs)


def test_a_failure_on_one_process_is_raised_on_every_process(tok):
    got = threaded(2, lambda share: ew.run(share, Boom, tok=tok))
    for e in got:
        assert isinstance(e, UserError) and "Boom.reset raised ValueError: no five" in str(e)


def test_an_environment_that_cannot_be_sent_fails_in_one_line(tok):
    got = threaded(2, lambda share: ew.run(share, Locked, tok=tok))
    for e in got:
        assert isinstance(e, UserError), e
        assert "the Locked environment of row 0 cannot be pickled" in str(e)
    ew.run(RowShare(), Locked, tok=tok)  # one process sends nothing


@pytest.mark.slow  # two processes through jax.distributed: about 20 s
def test_two_jax_processes_split_the_rows(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    script = os.path.join(os.path.dirname(__file__), "episode_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--process_id", str(i), "--coordinator", f"localhost:{port}"]
            + ["--out", str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert seen[0]["gathered"] == seen[1]["gathered"] == [3, 8]
    for key in ("chats", "tokens", "model_mask", "results", "entries"):
        assert seen[0][key] == seen[1][key], key
    owners = [{w.split(":")[0] for _, w in e} for e in seen[0]["entries"]]
    assert owners == [{"p0"}] * 3 + [{"p1"}] * 3
    assert sorted(c for s in seen for c in s["calls"]) == [
        ["p0:MainThread", "0*2"],
        ["p0:MainThread", "2*2"],
        ["p1:MainThread", "4*2"],
    ]
    assert [len(s["resets"]) for s in seen] == [3, 3]
