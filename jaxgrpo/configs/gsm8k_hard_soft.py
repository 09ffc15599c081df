"""GSM8K with the seed study's combined reward: exact answer plus embedding similarity."""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_hard_soft"
    c.task.name = "gsm8k_r1_traces"
    c.rewards.functions = (("hard_soft", 1.0),)
    return c
