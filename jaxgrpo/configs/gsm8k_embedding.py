"""GSM8K with the seed study's soft embedding reward: cosine(reasoning, reference reasoning)."""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_embedding"
    c.task.name = "gsm8k_r1_traces"
    c.rewards.functions = (("embedding", 1.0),)
    return c
