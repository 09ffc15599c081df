"""GSM8K, soft first then hard: the ablation the seed study proposes.

The embedding reward's weight ramps from 1 to 0 and the exact-answer weight from 0 to 1 over the
first 100 steps (curricula evaluated at the training step by the RewardSet).
"""

from jaxgrpo.configs import gsm8k_hard


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_curriculum"
    c.task.name = "gsm8k_r1_traces"
    c.rewards.functions = (
        (
            "embedding",
            {"kind": "linear", "start": 1.0, "end": 0.0, "start_step": 0, "end_step": 100},
        ),
        (
            "exact_answer",
            {"kind": "linear", "start": 0.0, "end": 1.0, "start_step": 0, "end_step": 100},
        ),
    )
    return c
