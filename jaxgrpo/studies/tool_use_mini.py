"""Does the embedded model learn to use a calculator? TRL's calculator experiment in miniature.

SmolLM2-135M-Instruct + LoRA on ``configs/calculator.py``: "What is a op b?" with numbers 10-999
(a 135M model cannot compute them in its head; ``calc`` computes them exactly), the exact answer
as the only reward, results masked from the loss. The tool arms' prompt shows one worked call
and one answer in words; the other arms' shows both in words, and they have no tool. Same
problems, steps (16 of 4 prompts x 8 episodes, temperature 0.7) and seed in every arm; the base
model is evaluated with and without the tool (``steps`` 0), and every arm on the same 64
held-out problems x 4 samples at temperature 0.6 (episodes with the tool where the arm has it).

The word-problem arms keep the arithmetic task of ``configs/arithmetic.py`` (two-step word
problems, numbers to 20, one worked example): with the tool, what is left to learn is which
expression to write.
"""

from jaxgrpo.run.study import Arm, Study

NO_TOOL = {"agent.tools": (), "task.kwargs.worked_calc": False}
WORDS = {
    "task.kwargs.kind": "word",
    "task.kwargs.max_number": 20,
    "sampling.max_new_tokens": 96,
    "agent.max_tool_tokens": 32,
}


def get_study():
    return Study(
        name="tool_use_mini",
        title="Tool use in miniature: SmolLM2-135M learns a calculator",
        base="calculator",
        evaluate_base=False,
        arms=[
            Arm("base_no_tool", {**NO_TOOL, "steps": 0}, "untrained, no tool"),
            Arm("base_calculator", {"steps": 0}, "untrained, with the calculator"),
            Arm("no_tool", NO_TOOL, "GRPO, no tool"),
            Arm("calculator", {}, "GRPO with the calculator"),
            Arm("words_no_tool", {**WORDS, **NO_TOOL}, "word problems: GRPO, no tool"),
            Arm("words_calculator", WORDS, "word problems: GRPO with the calculator"),
        ],
    )
