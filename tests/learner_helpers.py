"""Helpers shared by the tests that train the tiny model, also run as a worker process.

As a module: `text_reward` (a reward that varies with the sampled text, also used by config
files through its dotted path `learner_helpers.text_reward`), `make_learner`, `run_steps`,
`host_params`, `count_compiles` and `train_tiny_run`. Tests import it as `learner_helpers`
(conftest.py's directory is on `sys.path`), never as `tests.learner_helpers`, so there is one
module.

As a script: one of N `jax.distributed` processes (gloo CPU collectives) training the tiny
model for a few steps; process 0 writes the final parameters and per-step metrics:

    python tests/learner_helpers.py --process_id 0 --num_processes 2 \
        --coordinator localhost:12345 --steps 2 --out /tmp/x.npz
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax
import numpy as np

from jaxgrpo.core import sharding
from jaxgrpo.core.sharding import to_host
from jaxgrpo.data import get_task
from jaxgrpo.models.config import LoRAConfig
from jaxgrpo.models.layout import Layout, mesh_platform
from jaxgrpo.models.tiny import tiny_model
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rl.learner import Learner
from jaxgrpo.run import train
from jaxgrpo.settings.loading import load_config


def text_reward(prompts, completions, **_):
    """Varies with the sampled text, so every group has reward variance."""
    return [float(sum(map(ord, c)) % 7) / 7.0 for c in completions]


def make_learner(
    mesh_shape: dict,
    devices=None,
    reward=text_reward,
    agent=None,
    teacher=None,
    sampler_devices=None,
    **overrides,
):
    """(learner, format_copy task) for tiny.py with beta 0.04 and `reward`, on a mesh of
    `devices`; `overrides` are config keys (`"rl.grad_accum": 2`). LoRA adapters as the config
    says, none with `model.lora_rank=0` (as `jaxgrpo.run.train` builds the model), and the
    mesh's layout; the layers unrolled only with `model.layer_loop="unroll"`. `agent(tokenizer)`
    makes the learner's `jaxgrpo.agents.Agent`, whose environment's reward joins `reward`;
    `teacher(mesh, layout)` its frozen teacher model (with `teacher.*` overrides);
    `sampler_devices` a list of devices the sampler gets as a data-parallel mesh of its own."""
    base = {"run_dir": "/tmp/unused", "rl.beta": 0.04, "mesh.data": 1}
    cfg = load_config("tiny.py", {**base, **overrides})
    mesh = sharding.make_mesh(mesh_shape, devices=devices)
    rank = cfg.model.lora_rank
    lora = LoRAConfig(rank=rank, alpha=cfg.model.lora_alpha) if rank else None
    loop = "unroll" if cfg.model.layer_loop == "unroll" else "scan"
    layout = Layout.for_platform(mesh_platform(mesh), layer_loop=loop)
    remat = dict(remat=cfg.model.remat, remat_policy=cfg.model.remat_policy)
    model, tokenizer = tiny_model(lora, seed=cfg.seed, mesh=mesh, layout=layout, **remat)
    task = get_task("format_copy")
    rewards = [(reward, 1.0)]
    if agent is not None:
        agent = agent(tokenizer)
        rewards += [(fn, agent.reward_weight) for fn in agent.reward_functions()]
    teacher = teacher(mesh, layout) if teacher is not None else None
    sampler_mesh = None
    if sampler_devices is not None:
        sampler_mesh = sharding.make_mesh({"data": -1}, devices=sampler_devices)
    learner = Learner(
        cfg, model, tokenizer, task, RewardSet(rewards), mesh, agent, teacher, sampler_mesh
    )
    return learner, task


def run_steps(learner, examples, steps: int):
    """Trains `steps` steps from a fresh state on consecutive `prompts_per_step` slices of
    `examples`; returns (final state, per-step metrics)."""
    state, history = learner.init_state(), []
    b = learner.rl.prompts_per_step
    for i in range(steps):
        state, metrics, _ = learner.step(state, examples[i * b : (i + 1) * b])
        history.append(metrics)
    return state, history


def host_params(state) -> list[np.ndarray]:
    """The trainable parameters of `state` as host arrays, in leaf order."""
    return [to_host(x) for x in jax.tree.leaves(state.params)]


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block."""
    events = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def train_tiny_run(run_dir: str, steps: int) -> str:
    """Trains the tiny LoRA config `steps` steps into `run_dir`, checkpointing each step.

    The random model's rewards are all 0 (every advantage is 0), so an entropy bonus and a high
    learning rate are what move LoRA B off zero.
    """
    overrides = {
        "run_dir": run_dir,
        "steps": steps,
        "checkpoint.every": 1,
        "optim.lr": 0.05,
        "rl.entropy_coef": 1.0,
        "logging.tensorboard": False,
    }
    train.run(load_config("tiny", overrides))
    return run_dir


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    assert jax.process_count() == args.num_processes
    learner, task = make_learner({"data": 2, "fsdp": 1, "tensor": -1})
    state, history = run_steps(learner, list(task.train_examples(0)), args.steps)
    params = host_params(state)
    if jax.process_index() == 0:
        np.savez(args.out, *params)
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(history, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if not os.environ.get("JAX_PLATFORMS"):  # jax read the variable when imported above
        jax.config.update("jax_platforms", "cpu")
    _main()
