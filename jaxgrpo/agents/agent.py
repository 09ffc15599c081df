"""A run's agent: its tools, environment, call format and limits, and the episodes it starts.

``Agent`` is built once per run from the ``agent`` settings (``Agent.from_config``, which
resolves the config's names through ``Agent.from_names``). Each step it starts B * G episodes
(``start``): one environment instance per episode (TRL's ``environment_factory``), reset with
the example's columns, whose text is added to the prompt, and one ``Toolbox`` per episode;
then ``run`` samples them turn by turn (``rollout.run_episodes``). The tools are described to
the model in the system message (``ToolFormat.system_prompt``), which works with any chat
template, whether or not it renders tools itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxgrpo.agents.episode import with_observation
from jaxgrpo.agents.formats import get_format
from jaxgrpo.agents.rollout import AgentLimits, EpisodeBatch, Sampler, run_episodes
from jaxgrpo.agents.schema import ToolError
from jaxgrpo.agents.share import RowShare
from jaxgrpo.agents.tools import TOOLS, Toolbox, environment_reward, reset_environment
from jaxgrpo.core.dotted import import_dotted
from jaxgrpo.core.errors import ConfigError, UserError


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special-token strings (a tool result containing one is refused)."""
    decoder = getattr(tokenizer.hf, "added_tokens_decoder", {}) or {}
    found = [t.content for t in decoder.values() if getattr(t, "special", False)]
    return tuple(dict.fromkeys([*found, *getattr(tokenizer.hf, "all_special_tokens", [])]))


def with_instructions(messages: Sequence[Mapping], text: str) -> list[dict]:
    """``messages`` with ``text`` after their system message's content (or as a new system
    message first)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


class Agent:
    """The tools, environment, call format and limits of a run's episodes.

    Args:
      functions: stateless tool functions (TRL's ``tools=[...]``).
      environment: a class or factory called with no arguments for each episode (TRL's
        ``environment_factory``), or None.
      tokenizer: the policy's ``Tokenizer`` (its chat template picks the "auto" format, its
        special tokens may not appear in results).
      format: ``agent.format``.
      limits: turns, result tokens and call time of an episode.
      reward_weight: the weight of the environment's ``get_reward()`` (0: not used).
      share: which rows' environments and calls this process runs (default: this JAX
        process's contiguous block, ``RowShare.of_processes``, read when episodes start).

    Raises:
      ToolError: a tool whose schema cannot be built, or two tools with one name.
    """

    def __init__(
        self,
        functions: Sequence[Callable],
        environment: Callable[[], object] | None,
        tokenizer: Any,
        *,
        format: str = "auto",
        limits: AgentLimits = AgentLimits(),
        reward_weight: float = 1.0,
        share: RowShare | None = None,
    ):
        self.functions, self.environment, self._share = list(functions), environment, share
        self.tokenizer, self.limits = tokenizer, limits
        self.special_tokens = special_tokens(tokenizer)
        probe = self._toolbox(self._make_environment() if environment else None)
        self.schemas = probe.schemas
        self.format = get_format(format, self.schemas, getattr(tokenizer.hf, "chat_template", None))
        self.instructions = self.format.system_prompt(self.schemas) if self.schemas else ""
        env = probe.environment
        self.environment_name = type(env).__name__ if env is not None else None
        has_reward = callable(getattr(env, "get_reward", None))
        self.reward_weight = reward_weight if has_reward else 0.0

    @classmethod
    def from_names(
        cls,
        tools: Sequence[str],
        environment: str,
        tokenizer: Any,
        **kwargs: Any,
    ) -> Agent:
        """An agent from the config's names (``agent.tools``: ``TOOLS`` names or dotted
        paths; ``agent.environment``: a dotted path or "")."""
        functions = [_resolve(name, f"agent.tools[{i}]") for i, name in enumerate(tools)]
        factory = _resolve(environment, "agent.environment") if environment else None
        return cls(functions, factory, tokenizer, **kwargs)

    @classmethod
    def from_config(cls, agent: Any, tokenizer: Any) -> Agent | None:
        """The run's agent from its ``agent`` settings (``AgentConfig``, read by field: the
        settings lie above the agents), or None when they name neither tools nor an
        environment."""
        if not agent.enabled:
            return None
        return cls.from_names(
            agent.tools,
            agent.environment,
            tokenizer,
            format=agent.format,
            limits=AgentLimits(agent.max_turns, agent.max_tool_tokens, agent.tool_timeout_s),
            reward_weight=agent.environment_reward_weight,
        )

    @property
    def keeps_cache(self) -> bool:
        """Whether the sampler keeps each turn's KV cache: a later turn goes on from it."""
        return self.limits.max_turns > 1

    def _make_environment(self) -> object:
        try:
            return self.environment()
        except Exception as e:
            raise UserError(
                f"the environment factory {_name(self.environment)} raised {type(e).__name__}: {e}"
            ) from e

    def _toolbox(self, env: object | None) -> Toolbox:
        return Toolbox(self.functions, env, special_tokens=self.special_tokens)

    @property
    def share(self) -> RowShare:
        """Which rows' environments and calls this process runs."""
        if self._share is None:
            self._share = RowShare.of_processes()
        return self._share

    def start(
        self, examples: Sequence[Mapping], group: int
    ) -> tuple[list[list[dict]], list[Toolbox | None]]:
        """The B examples' prompt chats (the tools' instructions in the system message, then
        what the environments' ``reset`` returned after the last user message) and B * G
        toolboxes, one per episode, each with a fresh environment reset with its example's
        columns. With an environment, only the rows this process owns get one (and a toolbox;
        the others' are None): ``reset`` runs on each row's owner, and its text is sent to
        every process.

        Raises:
          UserError: ``reset`` raised, returned something but a string or None, or returned
            different text for the episodes of one prompt (its G episodes share one prompt).
        """
        n_rows = len(examples) * group
        if self.environment is None:
            texts, boxes = {}, [self._toolbox(None) for _ in range(n_rows)]
        else:
            envs: dict[int, object] = {}

            def reset(r: int) -> str | None:
                envs[r] = self._make_environment()
                columns = {k: v for k, v in examples[r // group].items() if k != "messages"}
                return self._reset(envs[r], columns, r // group)

            texts = self.share.map_rows(range(n_rows), n_rows, reset)
            boxes = [self._toolbox(envs[r]) if r in envs else None for r in range(n_rows)]
        chats = []
        for i, example in enumerate(examples):
            group_texts = [texts[r] for r in range(i * group, (i + 1) * group) if r in texts]
            if len(set(group_texts)) > 1:
                raise UserError(
                    f"{self.environment_name}.reset returned different text for the {group} "
                    f"episodes of example {i}; a prompt's group is sampled from one prompt, so "
                    "reset's text must depend on the example's columns only (seed any "
                    "randomness from them)"
                )
            messages = list(example["messages"])
            if self.instructions:
                messages = with_instructions(messages, self.instructions)
            chats.append(with_observation(messages, group_texts[0] if group_texts else None))
        return chats, boxes

    def _reset(self, env: object, columns: Mapping, example: int) -> str | None:
        try:
            return reset_environment(env, columns)
        except ToolError:
            raise
        except Exception as e:
            raise UserError(
                f"{self.environment_name}.reset raised {type(e).__name__}: {e} (example {example})"
            ) from e

    def run(
        self,
        sample: Sampler,
        toolboxes: Sequence[Toolbox | None],
        prompt_ids: np.ndarray,
        prompt_mask: np.ndarray,
        *,
        group: int,
        max_new_tokens: int,
    ) -> EpisodeBatch:
        """The episodes of B left-padded prompts, G per prompt (``rollout.run_episodes``),
        with each row's environment as its owner left it (``EpisodeBatch.environments``)."""
        batch = run_episodes(
            sample,
            self.tokenizer,
            self.format,
            toolboxes,
            prompt_ids,
            prompt_mask,
            group=group,
            max_new_tokens=max_new_tokens,
            limits=self.limits,
            share=self.share,
        )
        if self.environment is not None:
            n_rows = len(toolboxes)
            what = f"the {self.environment_name} environment"
            env = lambda r: toolboxes[r].environment  # noqa: E731
            envs = self.share.map_rows(range(n_rows), n_rows, env, what)
            batch.environments = [envs[r] for r in range(n_rows)]
        return batch

    def reward_function(self) -> Callable[..., list] | None:
        """The environment's ``get_reward()`` as a reward function over the ``environments``
        column, named after its class; None without one (or at weight 0)."""
        if not self.reward_weight:
            return None

        def score(environments, **_):
            return [environment_reward(env) for env in environments]

        score.__name__ = score.__qualname__ = self.environment_name
        return score


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _resolve(name: str, key: str) -> Callable:
    """A callable by ``TOOLS`` name or dotted path; ``ConfigError`` naming ``key``."""
    if name in TOOLS:
        return TOOLS[name]
    try:
        target = import_dotted(name)
    except ImportError as e:
        raise ConfigError(f"config key {key!r}: cannot import {name!r}: {e}") from None
    if not callable(target):
        kind = type(target).__name__
        raise ConfigError(f"config key {key!r}: {name!r} is a {kind}, not callable")
    return target
