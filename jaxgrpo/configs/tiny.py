"""A random tiny model ("tiny" alias) for CPU tests and the notebook: seconds per step."""

from jaxgrpo.configs import base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/tiny"
    c.steps = 4
    c.model.source = "tiny"
    c.model.lora_rank = 4
    c.model.lora_alpha = 8.0
    c.task.name = "format_copy"
    c.task.num_eval = 4
    c.rewards.functions = (("format_copy", 1.0),)
    c.sampling.max_new_tokens = 8
    c.rl.prompts_per_step = 2
    c.rl.group_size = 4
    c.optim.lr = 1e-3
    c.optim.schedule = "constant"
    c.checkpoint.every = 2
    c.logging.samples_every = 2
    c.logging.tensorboard = False
    c.logging.progress = False
    return c
