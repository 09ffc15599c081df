"""GSM8K with the seed study's soft perplexity reward: tanh of the delta-NLL under the base model.

Needs the reference reasoning traces (gsm8k_r1_traces).
"""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_perplexity"
    c.task.name = "gsm8k_r1_traces"
    c.rewards.functions = (("perplexity", 1.0),)
    return c
