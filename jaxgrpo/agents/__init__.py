"""Tool use over several turns, host side: tools, their schemas, call formats, episode records.

jaxgrpo trains agents the way TRL's ``GRPOTrainer`` does: users bring stateless tool functions
(``tools=[fn, ...]``, sync or ``async def``) and/or an environment class (``environment_factory``:
one instance per rollout, or a dict of them picked by each example's ``environment`` column;
``reset(**row)``, ``get_reward()``, every other public method a tool). This package is the part
of that feature that is plain Python, with no JAX:

- ``schema``: a function's JSON schema from its type hints and Google-style docstring, as
  ``transformers.utils.get_json_schema`` builds it: what the model is told.
- ``tools``: ``Toolbox``, the tools of one rollout; ``Toolbox.run_all`` runs a turn's calls (the
  async ones together) and never raises: every failure (malformed call, unknown tool, arguments
  that do not fit, an exception, a timeout, an oversized result, a result with control tokens)
  becomes TRL's error text the model reads and a counted error kind. Also the environment
  contract (``environment_tools``, ``reset_row``, ``reset_environment``,
  ``environment_reward``).
- ``formats``: how calls are written and results rendered (``json``: Qwen's ``<tool_call>``;
  ``llama3``: Llama 3.1's JSON turn and ``ipython`` message; ``tag``: ``<calc>..</calc>`` answered
  in the same turn); where the chat template renders tools, results are rendered by it
  (``template_results``), so the appended result tokens are those of its ``tool`` messages.
- ``episode``: the record of one rollout's turns, its TRL conversational form (for reward
  functions) and the step's ``agent/...`` metrics.
- ``calculator``: ``calc``, the arithmetic tool of the tool-use study.
- ``python_tool``: ``python``, which runs the model's code in the code sandbox and returns what
  it printed. ``tools.TOOLS`` names the built-in tools.

- ``agent``: ``Agent``, a run's tools, environments, format and limits: it starts each step's
  episodes (an environment per episode, reset with the example's row; the tools described by
  the chat template where it renders them, ``prompt_tools``, else in the system message) and
  runs them; the environments' ``get_reward()`` as reward functions.
- ``seam``: where a calling turn's model ids end and the format's text begins, whatever the
  tokenizer merged into the call's last id.
- ``rollout``: ``run_episodes``, the host loop over a sampler: a turn for every row, its calls
  run, the results' ids appended with model mask 0 (cut to ``max_tool_tokens``), the rows that
  called sampled again from their kept KV cache, until a turn without a call, ``max_turns`` or
  the episode's token budget. The sampled ids are kept as drawn, never re-tokenized from text.
- ``share``: ``RowShare``, which process owns each row of a multi-process batch (runs its
  environment's ``reset`` and its calls) and sends the outcomes to the others.

The learner (``jaxgrpo.rl.learner``) trains on the episodes with the results' ids masked from
the loss; the ``agent`` config section builds the ``Agent``.
"""

from __future__ import annotations

from jaxgrpo.agents.agent import Agent
from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.episode import Episode, Turn, metrics, turn_records, with_observation
from jaxgrpo.agents.formats import (
    FORMATS,
    JsonFormat,
    Llama3Format,
    TagFormat,
    ToolCall,
    ToolFormat,
    detect_format,
    get_format,
)
from jaxgrpo.agents.python_tool import python
from jaxgrpo.agents.rollout import AgentLimits, EpisodeBatch, model_sampler, run_episodes
from jaxgrpo.agents.schema import ToolError, tool_schema
from jaxgrpo.agents.share import RowShare
from jaxgrpo.agents.tools import (
    ERROR_KINDS,
    TOOLS,
    Toolbox,
    ToolResult,
    contains_control_tokens,
    environment_reward,
    environment_tools,
    reset_environment,
    reset_row,
)

__all__ = [
    "Agent",
    "AgentLimits",
    "ERROR_KINDS",
    "EpisodeBatch",
    "FORMATS",
    "Episode",
    "JsonFormat",
    "Llama3Format",
    "TOOLS",
    "TagFormat",
    "RowShare",
    "ToolCall",
    "ToolError",
    "ToolFormat",
    "ToolResult",
    "Toolbox",
    "Turn",
    "calc",
    "contains_control_tokens",
    "detect_format",
    "environment_reward",
    "environment_tools",
    "get_format",
    "metrics",
    "model_sampler",
    "python",
    "reset_environment",
    "reset_row",
    "run_episodes",
    "tool_schema",
    "turn_records",
    "with_observation",
]
