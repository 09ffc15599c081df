"""SmolLM2-135M-Instruct + LoRA on seeded arithmetic word problems, the seed study's prompt and
its hard reward: the base of the miniature reward-structure study (studies/).

The task (``jaxgrpo.data.arithmetic``) keeps GSM8K's shape at a difficulty a 135M model can
partly solve: two-step problems with numbers up to 20, each with a worked reasoning for the
soft rewards. Runs offline on a 2-core CPU; the base model's accuracy is in
studies/reward_structure_mini.py.
"""

from jaxgrpo.configs import base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/arithmetic"
    c.steps = 20
    c.model.source = "smollm2"
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.task.name = "arithmetic"
    c.task.num_eval = 64
    c.task.kwargs.ops = 2
    c.task.kwargs.max_number = 20
    c.task.kwargs.worked_example = True
    c.rewards.functions = (("exact_answer", 1.0),)
    c.sampling.max_new_tokens = 96
    c.sampling.temperature = 1.0
    c.rl.prompts_per_step = 4
    c.rl.group_size = 8
    c.rl.beta = 0.0
    c.optim.lr = 2e-4
    c.optim.warmup_steps = 2
    c.optim.schedule = "constant"
    c.checkpoint.every = 10
    c.logging.samples_every = 5
    c.eval.every = 10
    c.eval.num_samples = 8  # pass@8, as the seed study reports
    c.eval.max_new_tokens = 128
    c.eval.batch_size = 16
    return c
