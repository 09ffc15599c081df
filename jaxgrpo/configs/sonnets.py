"""Sonnet writing (non-verifiable): line count, ABAB CDCD EFEF GG rhyme and iambic meter rewards.

The repetition guard stops the degenerate loops the seed study saw under hard sonnet rewards.
"""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/sonnets"
    c.steps = 50
    c.task.name = "sonnets"
    c.task.num_eval = 32
    c.rewards.functions = (("sonnet_form", 1.0),)
    c.sampling.max_new_tokens = 256
    c.sampling.repetition_guard = (4, 8)
    c.rl.entropy_coef = 0.001
    return c
