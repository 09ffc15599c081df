"""SmolLM2-135M-Instruct + LoRA learns a calculator: TRL's calculator task for the embedded model.

The ``arithmetic`` task's expression kind ("What is 913 * 510?", numbers 10-999, + - *): exact
answers a 135M model cannot compute in its head (untrained, without a tool: 9.4% strict on 16
held-out problems x 4), which the ``calc`` tool computes exactly. As in TRL's calculator example
the reward is the exact answer alone and results are masked from the loss; the prompt shows two
worked examples, one answered with the calculator (``<calc>250+117</calc>`` answered by
``<result>367</result>`` in the same turn) and one in words, so the untrained model calls the
tool in some episodes and not others, and GRPO has groups whose episodes differ. (With both
examples calling it, as in TRL's prompt, the untrained model already calls it in every episode
and scores 100%: nothing is left to learn.)

The episode (the call, its result and the answer) fits 48 tokens; training samples at 0.7,
near the evaluation's 0.6, so a group is not all wrong.
"""

from jaxgrpo.configs import arithmetic


def get_config():
    c = arithmetic.get_config()
    c.run_dir = "runs/calculator"
    c.steps = 16
    c.task.kwargs.kind = "expression"
    c.task.kwargs.max_number = 999
    c.task.kwargs.worked_calc = True
    c.task.kwargs.worked_calls = 1
    c.agent.tools = ("calc",)
    c.agent.format = "tag"
    c.agent.max_turns = 3
    c.agent.max_tool_tokens = 32
    c.sampling.max_new_tokens = 48
    c.sampling.temperature = 0.7
    c.eval.every = 8
    c.eval.num_samples = 4
    c.eval.max_new_tokens = 96  # the word-problem arms of studies/tool_use_mini need 96
    return c
