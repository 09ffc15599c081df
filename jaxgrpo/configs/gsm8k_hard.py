"""GSM8K with the seed study's hard reward: 1 when the number in <answer> equals the reference.

The seed study's setting: Llama-3.1-8B-Instruct (abliterated), LoRA, 512 new tokens. Sized for a
TPU pod slice: parameters sharded over every device (fsdp fills the mesh).
"""

from jaxgrpo.configs import base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/gsm8k_hard"
    c.steps = 250
    c.model.source = "mlabonne/Meta-Llama-3.1-8B-Instruct-abliterated"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = True
    c.task.name = "gsm8k"
    c.task.num_eval = 100
    c.rewards.functions = (("exact_answer", 1.0),)
    c.sampling.max_new_tokens = 512
    c.sampling.temperature = 1.0
    c.rl.prompts_per_step = 16
    c.rl.group_size = 8
    c.rl.beta = 0.04
    c.rl.grad_accum = 1  # 16 packed rows (one per prompt) split over up to 16 data x fsdp shards
    c.optim.lr = 5e-6
    c.optim.warmup_steps = 10
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.checkpoint.every = 25
    return c
