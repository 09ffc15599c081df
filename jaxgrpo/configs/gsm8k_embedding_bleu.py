"""GSM8K with the seed study's hybrid soft reward: 0.7 * cosine + 0.3 * BLEU."""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_embedding_bleu"
    c.task.name = "gsm8k_r1_traces"
    c.rewards.functions = (("embedding_bleu", 1.0),)
    return c
