"""On-policy distillation in miniature: does a fresh SmolLM2-135M learn format_copy's answer
format from a teacher's log-probs alone?

The teacher is the quickstart's trained run (``runs/format_copy``: ``python -m jaxgrpo.train
--config format_copy.py`` writes it; 0/64 -> 63/64 held-out strict accuracy), loaded with its
LoRA merged. Every arm is the quickstart's recipe (configs/format_copy.py: same prompts,
curriculum, 20 steps, learning rate and seed) with a fresh LoRA on the untrained model:

- ``reward``: the quickstart itself, the format reward and no teacher;
- ``distill``: no task reward at all; each sampled token's advantage is the teacher's log-prob
  of it minus the student's (the per-token reverse KL, stop-gradient: ``teacher.distill_coef``);
- ``reward_distill``: both.

Held-out strict accuracy every 5 steps (greedy, the plain prompt) is each arm's curve; the
reverse KL to the teacher is in every distilling arm's metrics (``teacher/reverse_kl``).
"""

from jaxgrpo.run.study import Arm, Study

TEACHER = {"teacher.source": "runs/format_copy", "teacher.distill_coef": 1.0}


def get_study():
    return Study(
        name="distill_mini",
        title="On-policy distillation in miniature: SmolLM2-135M learns format_copy from a teacher",
        base="format_copy",
        arms=[
            Arm("distill", {**TEACHER, "rewards.functions": ()}, "the teacher alone, no reward"),
            Arm("reward", {}, "the quickstart: the format reward, no teacher"),
            Arm("reward_distill", TEACHER, "the format reward and the teacher"),
        ],
    )
