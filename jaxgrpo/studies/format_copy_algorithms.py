"""The course's question on format_copy: GRPO vs GR-REINFORCE vs Dr. GRPO vs DAPO.

The embedded default (configs/format_copy.py) with only ``rl.loss_type`` changed; the length of
correct and incorrect completions is in every arm's metrics (the dashboard's Dr. GRPO panel) and
in the results table.
"""

from jaxgrpo.study import Arm, Study


def get_study():
    return Study(
        name="format_copy_algorithms",
        title="GRPO-family objectives on format_copy (SmolLM2-135M)",
        base="format_copy",
        arms=[
            Arm(name, {"rl.loss_type": name}, note)
            for name, note in (
                ("grpo", "sequence-mean loss, group-std advantages, clip 0.2"),
                ("gr_reinforce", "no ratio clipping: REINFORCE with the group baseline"),
                ("dr_grpo", "no std scaling, constant normaliser"),
                ("dapo", "token-level loss (token-mean normaliser; clip bounds as in the base)"),
            )
        ],
    )
