"""The seed study's five reward structures and its two proposals, in miniature (configs/arithmetic).

SmolLM2-135M-Instruct + LoRA on seeded two-step arithmetic word problems in GSM8K's format, the
seed study's prompt with one worked example. Base model on the 64 held-out problems
(``python -m jaxgrpo.evaluate --config arithmetic --base``: 8 samples each, 128 tokens,
temperature 0.6, top-p 0.95): strict 22.7%, lenient 23.6%, format 89.6%, pass@8 54.7%. Without
the worked example (32 prompts x 4 samples) it scored strict 0%, lenient 10.9%, format 0%.

Every arm has the same steps, seed and prompts; only rewards or the temperature schedule differ.
``--base gsm8k_hard`` runs the same arms at TPU scale (the curriculum scales with ``steps``).
"""

from jaxgrpo.run.study import Arm, Study


def _curriculum(c):
    """Embedding weight 1 -> 0 and exact-answer weight 0 -> 1 over the first half of the run."""
    ramp = {"kind": "linear", "start_step": 0, "end_step": max(1, c.steps // 2)}
    return (
        ("embedding", {**ramp, "start": 1.0, "end": 0.0}),
        ("exact_answer", {**ramp, "start": 0.0, "end": 1.0}),
    )


def get_study():
    return Study(
        name="reward_structure_mini",
        title="The seed study in miniature: reward structures (SmolLM2-135M, arithmetic)",
        base="arithmetic",
        arms=[
            Arm("hard", {"rewards.functions": (("exact_answer", 1.0),)}, "exact answer, 0/1"),
            Arm("perplexity", {"rewards.functions": (("perplexity", 1.0),)}, "tanh delta-NLL"),
            Arm("embedding", {"rewards.functions": (("embedding", 1.0),)}, "MiniLM cosine"),
            Arm(
                "embedding_bleu",
                {"rewards.functions": (("embedding_bleu", 1.0),)},
                "0.7 cosine + 0.3 BLEU",
            ),
            Arm("hard_soft", {"rewards.functions": (("hard_soft", 1.0),)}, "exact + cosine"),
            Arm("soft_then_hard", {"rewards.functions": _curriculum}, "the seed's proposal"),
            Arm(
                "hard_anneal",
                {
                    "rewards.functions": (("exact_answer", 1.0),),
                    "sampling.temperature": 1.2,
                    "sampling.temperature_schedule.kind": "cosine",
                    "sampling.temperature_schedule.end": 0.6,
                },
                "exact answer, temperature 1.2 -> 0.6 (cosine)",
            ),
        ],
    )
