"""Episodes split over processes: each row's environment and calls run on its owner only.

As a module: ``Ledger`` (an environment whose tool records which thread ran it), ``calc`` (logged),
``scripted`` (a policy that writes ``<note>rN</note>`` in turn 0, ``<calc>N*2</calc>`` in turn 1
for even rows, then answers) and ``run`` (one agent's episodes under a ``RowShare``). Tests import
it as ``episode_worker`` (pytest puts this folder on ``sys.path``).

As a script: one of two ``jax.distributed`` processes (gloo CPU collectives) running ``run``
under ``RowShare.of_processes()``; each writes what it saw as JSON:

    python tests/agents/episode_worker.py --process_id 0 --coordinator localhost:1234 --out d/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import types

import numpy as np

from jaxgrpo.agents import Agent, calculator
from jaxgrpo.agents.share import RowShare
from jaxgrpo.models.tiny import tiny_tokenizer

T = 64
GROUP = 3
EXAMPLES = [
    {"messages": [{"role": "user", "content": "Note it."}], "answer": "3"},
    {"messages": [{"role": "user", "content": "Note that."}], "answer": "5"},
]
CALLS: list[tuple[str, str]] = []  # (thread, expression) of every calc call
RESETS: list[str] = []  # the thread of every Ledger.reset
_LOCK = threading.Lock()


def who() -> str:
    """This thread's name, with the process's id when there are several."""
    return f"{os.environ.get('WORKER_ID', '')}{threading.current_thread().name}"


class Ledger:
    """An environment whose tool notes its text and the thread that ran it."""

    def reset(self, answer, **kwargs):
        self.entries = []
        with _LOCK:
            RESETS.append(who())
        return f" Reach {answer}."

    def note(self, text: str) -> str:
        """Notes the text.

        Args:
            text: what to note.
        """
        self.entries.append((text, who()))
        return f"noted {text}"

    def get_reward(self) -> float:
        return float(len(self.entries))


def calc(expression: str) -> str:
    """Evaluates arithmetic.

    Args:
        expression: the arithmetic to evaluate.
    """
    with _LOCK:
        CALLS.append((who(), expression))
    return calculator.calc(expression)


def scripted(tok):
    """Turn 0: row N notes ``rN`` and runs on (ids the rollout drops); turn 1: even rows call
    the calculator, odd rows answer; turn 2: every row answers."""
    enc = lambda text: tok.hf.encode(text, add_special_tokens=False)  # noqa: E731
    answer = [*enc("<answer>ok</answer>"), tok.eos_ids[0]]

    def sample(ids, mask, num_samples, max_lengths, turn, resume=None):
        n = ids.shape[0] * num_samples
        turns = []
        for i in range(n):
            if turn == 0:
                turns.append(enc(f"<note>r{i}</note> and more"))
                continue
            context = tok.hf.decode(ids[i // num_samples][mask[i // num_samples] != 0].tolist())
            row = int(re.search(r"<note>r(\d+)</note>", context).group(1))
            calls = turn == 1 and row % 2 == 0
            turns.append(enc(f"<calc>{row}*2</calc>") if calls else answer)
        tokens = np.zeros((n, T), np.int32)
        for i, t in enumerate(turns):
            tokens[i, : len(t)] = t
        return types.SimpleNamespace(
            tokens=tokens,
            lengths=np.asarray([len(t) for t in turns]),
            logprobs=np.full((n, T), -0.5, np.float32),
            temperatures=np.ones((n, T), np.float32),
        )

    return sample


def run(share: RowShare, environment=Ledger, tok=None):
    """(chats, EpisodeBatch) of ``EXAMPLES``' episodes, ``GROUP`` per example, under ``share``."""
    tok = tok or tiny_tokenizer()
    agent = Agent([calc], environment, tok, format="tag", share=share)
    chats, boxes = agent.start(EXAMPLES, GROUP)
    ids, mask = tok.encode_chat(chats)
    return chats, agent.run(scripted(tok), boxes, ids, mask, group=GROUP, max_new_tokens=T)


def summary(chats, batch) -> dict:
    """What a process saw, as JSON values."""
    return {
        "chats": chats,
        "tokens": batch.tokens.tolist(),
        "model_mask": batch.model_mask.tolist(),
        "results": [[r.text for t in e.turns for r in t.results] for e in batch.episodes],
        "entries": [env.entries for env in batch.environments],
        "calls": CALLS,
        "resets": RESETS,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["WORKER_ID"] = f"p{args.process_id}:"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, 2, args.process_id)
    from jaxgrpo.core.sharding import allgather_bytes

    gathered = allgather_bytes(b"x" * (3 + 5 * args.process_id))
    chats, batch = run(RowShare.of_processes())
    out = summary(chats, batch) | {"gathered": [len(b) for b in gathered]}
    with open(os.path.join(args.out, f"{args.process_id}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
