"""GRPO vs GR-REINFORCE vs Dr. GRPO vs DAPO on format_copy.

The embedded default (configs/format_copy.py) with only ``rl.loss_type`` changed; the length of
correct and incorrect completions is in every arm's metrics (the dashboard's Dr. GRPO panel) and
in the results table. With one update per sampled batch the policy ratio is 1 at every update,
so GRPO's clipping never acts and GRPO equals GR-REINFORCE step for step; the two
``*_2epochs`` arms take two passes over each batch (``rl.ppo_epochs``), where the second pass is
off-policy and the clip can bind.
"""

from jaxgrpo.run.study import Arm, Study


def get_study():
    arms = [
        Arm(name, {"rl.loss_type": name}, note)
        for name, note in (
            ("grpo", "sequence-mean loss, group-std advantages, clip 0.2"),
            ("gr_reinforce", "no ratio clipping: REINFORCE with the group baseline"),
            ("dr_grpo", "no std scaling, constant normaliser"),
            ("dapo", "token-level loss (token-mean normaliser; clip bounds as in the base)"),
        )
    ]
    arms += [
        Arm(f"{name}_2epochs", {"rl.loss_type": name, "rl.ppo_epochs": 2}, f"{name}, two passes")
        for name in ("grpo", "gr_reinforce")
    ]
    return Study(
        name="format_copy_algorithms",
        title="GRPO-family objectives on format_copy (SmolLM2-135M)",
        base="format_copy",
        arms=arms,
    )
