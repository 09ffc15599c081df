"""Helpers of tests/test_distributed.py, also run as a worker process.

As a module: `text_reward` (a reward that varies with the sampled text, also used by config
files through its dotted path `learner_helpers.text_reward`), `build` and `run_steps`.

As a script: one of N `jax.distributed` processes (gloo CPU collectives) training the tiny
model for a few steps; process 0 writes the final parameters and per-step metrics:

    python tests/learner_helpers.py --process_id 0 --num_processes 2 \
        --coordinator localhost:12345 --steps 2 --out /tmp/x.npz
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

STEPS_EXAMPLES = 2  # prompts per step (tiny.py's rl.prompts_per_step)


def text_reward(prompts, completions, **_):
    """Varies with the sampled text, so every group has reward variance."""
    return [float(sum(map(ord, c)) % 7) / 7.0 for c in completions]


def build(mesh_shape: dict, devices=None):
    """(learner, task) for tiny.py with beta > 0 and `text_reward`, on a mesh of `devices`."""
    from jaxgrpo import sharding
    from jaxgrpo.config import load_config
    from jaxgrpo.data import get_task
    from jaxgrpo.models.config import LoRAConfig
    from jaxgrpo.rewards import RewardSet
    from jaxgrpo.rl.learner import Learner
    from jaxgrpo.rl.tiny import tiny_model

    cfg = load_config("tiny.py", {"run_dir": "/tmp/unused", "rl.beta": 0.04, "mesh.data": 1})
    mesh = sharding.make_mesh(mesh_shape, devices=devices)
    lora = LoRAConfig(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)
    model, tokenizer = tiny_model(lora, seed=cfg.seed, mesh=mesh)
    task = get_task("format_copy")
    return Learner(cfg, model, tokenizer, task, RewardSet([(text_reward, 1.0)]), mesh), task


def run_steps(learner, task, steps: int):
    """Trains `steps` steps from a fresh state; returns (host params list, metrics list)."""
    import jax

    from jaxgrpo.sharding import to_host

    examples = list(task.train_examples(0))
    state = learner.init_state()
    history = []
    for i in range(steps):
        batch = examples[i * STEPS_EXAMPLES : (i + 1) * STEPS_EXAMPLES]
        state, metrics, _ = learner.step(state, batch)
        history.append(metrics)
    return [to_host(x) for x in jax.tree.leaves(state.params)], history


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    assert jax.process_count() == args.num_processes
    learner, task = build({"data": 2, "fsdp": 1, "tensor": -1})
    params, history = run_steps(learner, task, args.steps)
    if jax.process_index() == 0:
        np.savez(args.out, *params)
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(history, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _main()
