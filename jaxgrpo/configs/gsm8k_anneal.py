"""GSM8K with the hard reward and temperature annealing: the seed study's proposal to "start at
higher temperatures and eventually lower the temperature".

Sampling starts at temperature 1.2 (diverse groups while the policy knows little) and falls on a
cosine to 0.6, the evaluation temperature, over the run; within each completion the temperature
is constant (the position schedule stays off). Everything else is ``gsm8k_hard``.
"""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_anneal"
    c.sampling.temperature = 1.2
    c.sampling.temperature_schedule.kind = "cosine"
    c.sampling.temperature_schedule.end = 0.6
    return c
