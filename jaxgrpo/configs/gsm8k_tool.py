"""GSM8K with the hard reward, where the model may run Python while it solves a problem.

Everything is ``gsm8k_hard`` (model, batch, 512-token budget, data from the hub or local files
via ``task.kwargs.source``), plus the built-in ``python`` tool: each rollout is an episode of
up to four model turns, a call's printed output (cut at 256 tokens) is appended to the context
and attended but not trained on, and the reward reads the episode's last <answer>. The
format is the chat template's own ("auto": Llama 3.1's JSON call turn for gsm8k_hard's model,
Qwen's <tool_call> JSON for a Qwen model such as Qwen2.5-Math-1.5B-Instruct). The 512 tokens
count the whole episode, results included. The sampler of later turns (every row continued
from its kept KV cache, with a copy of its prompt's) holds the step's largest cache;
``python -m jaxgrpo.compile --config gsm8k_tool --topology v5e-64`` says whether it fits.
"""

from jaxgrpo.configs import gsm8k_hard

# Placed before the tool's description in the system message (jaxgrpo.agents.Agent).
SYSTEM_PROMPT = (
    "You can run Python to check your arithmetic: call the python tool with a short program "
    "that prints the values you need, and read its output before you go on. Use it when a "
    "calculation is error-prone; it is optional."
)


def get_config():
    c = gsm8k_hard.get_config()
    c.run_dir = "runs/gsm8k_tool"
    c.task.system_prompt = SYSTEM_PROMPT
    c.agent.tools = ("python",)
    c.agent.format = "auto"
    c.agent.max_turns = 4
    c.agent.max_tool_tokens = 256
    c.agent.tool_timeout_s = 10.0
    return c
