"""Does the embedded model learn to use a calculator? Tool use in miniature (configs/arithmetic).

SmolLM2-135M-Instruct + LoRA on the seeded two-step arithmetic problems, the study's base
config unchanged (20 steps of 4 prompts x 8 samples, exact-answer reward, no KL), with and
without the calculator tool (``agents.calc`` in the tag format: ``<calc>4*3+5</calc>`` answered
by ``<result>17</result>`` in the same turn, up to 4 model turns per episode, the episode's 96
tokens counting the results). The tool arms' worked example computes with the tool; the others'
reasons in words. Same problems, steps and seed in every arm; the base model is evaluated with
and without the tool (``steps`` 0), and every arm on the same 64 held-out problems x 8 samples
(episodes with the tool where the arm has it).
"""

from jaxgrpo.run.study import Arm, Study

CALCULATOR = {
    "agent.tools": ("calc",),
    "agent.format": "tag",
    "agent.max_turns": 4,
    "task.kwargs.worked_calc": True,
}


def get_study():
    return Study(
        name="tool_use_mini",
        title="Tool use in miniature: a calculator for SmolLM2-135M on arithmetic",
        base="arithmetic",
        arms=[
            Arm("no_tool", {}, "GRPO, no tool"),
            Arm("base_calculator", {**CALCULATOR, "steps": 0}, "untrained, with the calculator"),
            Arm("calculator", CALCULATOR, "GRPO with the calculator"),
        ],
    )
