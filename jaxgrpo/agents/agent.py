"""A run's agent: its tools, environments, call format and limits, and the episodes it starts.

``Agent`` is built once per run from the ``agent`` settings (``Agent.from_config``, which
resolves the config's names through ``Agent.from_names``) or from Python objects as TRL's
``GRPOTrainer`` takes them (``tools=[...]``, ``environment_factory``: one factory, or a dict of
names to factories, each example picking one by its ``environment`` column). Each step it
starts B * G episodes (``start``): one environment instance per episode, reset with the
example's row (``tools.reset_row``: ``prompt`` and every other column), whose text is added to
the prompt, and one ``Toolbox`` per episode; then ``run`` samples them turn by turn
(``rollout.run_episodes``).

How the tools are described to the model follows the chat template. One that renders a
``tools=`` list (Qwen2.5's, Qwen3's, Llama 3.1's) renders each prompt with its example's tools'
schemas, as TRL does (``prompt_tools``, passed to ``Tokenizer.encode_chat``), and writes the
results as its own ``tool`` messages (``formats.template_results``). One that does not
(SmolLM2's) gets them in the system message (``ToolFormat.system_prompt``) and the format's own
result layout. ``tools_line`` says which, in the run's header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxgrpo.agents.episode import with_observation
from jaxgrpo.agents.formats import detect_format, get_format
from jaxgrpo.agents.rollout import AgentLimits, EpisodeBatch, Sampler, run_episodes
from jaxgrpo.agents.schema import ToolError
from jaxgrpo.agents.share import RowShare
from jaxgrpo.agents.tools import (
    TOOLS,
    Toolbox,
    environment_reward,
    reset_environment,
    reset_row,
)
from jaxgrpo.core.dotted import import_dotted
from jaxgrpo.core.errors import ConfigError, UserError

_PROBE = [{"role": "user", "content": "dummy"}]  # the chat that tells whether tools render


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


def renders_tools(tokenizer: Any, schemas: Sequence[Mapping]) -> bool:
    """Whether the tokenizer's chat template renders a ``tools=`` list: a chat rendered with
    the schemas differs from it without them and names every tool."""
    if not schemas or not getattr(tokenizer.hf, "chat_template", None):
        return False
    try:
        plain = tokenizer.apply_chat_template(_PROBE)
        text = tokenizer.apply_chat_template(_PROBE, tools=list(schemas))
    except Exception:  # a template that cannot take tools says so by raising
        return False
    return text != plain and all(s["function"]["name"] in text for s in schemas)


class Agent:
    """The tools, environments, call format and limits of a run's episodes.

    Args:
      functions: stateless tool functions (TRL's ``tools=[...]``), sync or ``async def``.
      environment: TRL's ``environment_factory``: a class or factory called with no arguments
        for each episode, or a mapping of names to such factories (each example picks one by
        its ``environment`` column), or None.
      tokenizer: the policy's ``Tokenizer`` (its chat template picks the "auto" format and
        whether it describes the tools, its special tokens may not appear in results).
      format: ``agent.format``.
      limits: turns, result tokens and call time of an episode.
      reward_weight: the weight of the environments' ``get_reward()`` (0: not used).
      share: which rows' environments and calls this process runs (default: this JAX
        process's contiguous block, ``RowShare.of_processes``, read when episodes start).

    Raises:
      ToolError: a tool whose schema cannot be built, or two tools with one name.
      UserError: an environment factory raised.
    """

    def __init__(
        self,
        functions: Sequence[Callable],
        environment: Callable[[], object] | Mapping[str, Callable[[], object]] | None,
        tokenizer: Any,
        *,
        format: str = "auto",
        limits: AgentLimits = AgentLimits(),
        reward_weight: float = 1.0,
        share: RowShare | None = None,
    ):
        self.functions, self.environment, self._share = list(functions), environment, share
        self.tokenizer, self.limits = tokenizer, limits
        self.multi_environment = isinstance(environment, Mapping)
        if environment is None:
            self.factories: dict[str | None, Callable] = {}
        else:
            self.factories = dict(environment) if self.multi_environment else {None: environment}
        self.special_tokens = special_tokens(tokenizer)
        probes = {name: self._make_environment(name) for name in self.factories}
        boxes = {name: self._toolbox(env) for name, env in probes.items()} or {
            None: self._toolbox(None)
        }
        self.tool_schemas = {name: box.schemas for name, box in boxes.items()}
        union = {s["function"]["name"]: s for box in boxes.values() for s in box.schemas}
        self.schemas = list(union.values())
        template = getattr(tokenizer.hf, "chat_template", None)
        kind = detect_format(template) if format == "auto" else format
        self.format = get_format(kind, self.schemas, template)
        self.template_tools = kind != "tag" and self._use_template(kind, template)
        self.instructions = self._instructions()
        self.environment_types = {name: type(env) for name, env in probes.items()}
        types = list(self.environment_types.values())
        self.environment_name = ", ".join(dict.fromkeys(t.__name__ for t in types)) or None
        self.reward_types = [
            t for t in dict.fromkeys(types) if callable(getattr(t, "get_reward", None))
        ]
        self.reward_weight = reward_weight if self.reward_types else 0.0

    def _use_template(self, kind: str, template: str | None) -> bool:
        """Whether the chat template renders the tools and their results; if so, the format
        writes results through it."""
        if not renders_tools(self.tokenizer, self.schemas):
            return False
        hf = self.tokenizer.hf
        ends = [hf.decode([i], skip_special_tokens=False) for i in self.tokenizer.eos_ids]
        fmt = get_format(kind, self.schemas, template, self._render, ends)
        try:
            probe = fmt.render_results([(self.schemas[0]["function"]["name"], "17")])
        except Exception:  # renders tools, not their results: the format's own layout
            return False
        if "17" not in probe:
            return False
        self.format = fmt
        return True

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def _instructions(self) -> dict[str | None, str]:
        """Per environment, what the system message gets: the tools' description where the
        template does not render them, else nothing."""
        if self.template_tools:
            return {name: "" for name in self.tool_schemas}
        return {
            name: self.format.system_prompt(schemas) if schemas else ""
            for name, schemas in self.tool_schemas.items()
        }

    @property
    def prompt_chars(self) -> int:
        """The most characters the tools' description adds to a prompt (for sizing)."""
        if not self.template_tools:
            return max(map(len, self.instructions.values()), default=0)
        plain = len(self.tokenizer.apply_chat_template(_PROBE))
        return max(
            len(self.tokenizer.apply_chat_template(_PROBE, tools=s)) - plain if s else 0
            for s in self.tool_schemas.values()
        )

    @property
    def tools_line(self) -> str:
        """What the run's header says about the tools and how the model is told of them."""
        names = ", ".join(s["function"]["name"] for s in self.schemas) or "none"
        if self.template_tools:
            how = "rendered by the chat template"
        elif self.format.name == "tag":
            how = "described in the system message (the tag format)"
        else:
            how = "described in the system message (the chat template does not render tools)"
        return f"{names}; {self.format.name} calls; {how}"

    @classmethod
    def from_names(
        cls,
        tools: Sequence[str],
        environment: str | Mapping[str, str],
        tokenizer: Any,
        **kwargs: Any,
    ) -> Agent:
        """An agent from the config's names (``agent.tools``: ``TOOLS`` names or dotted
        paths; ``agent.environment``: a dotted path or "", or a mapping of names to dotted
        paths, ``agent.environments``)."""
        functions = [_resolve(name, f"agent.tools[{i}]") for i, name in enumerate(tools)]
        if isinstance(environment, Mapping):
            factory = {
                name: _resolve(path, f"agent.environments.{name}")
                for name, path in environment.items()
            }
        else:
            factory = _resolve(environment, "agent.environment") if environment else None
        return cls(functions, factory or None, tokenizer, **kwargs)

    @classmethod
    def from_config(cls, agent: Any, tokenizer: Any) -> Agent | None:
        """The run's agent from its ``agent`` settings (``AgentConfig``, read by field: the
        settings lie above the agents), or None when they name neither tools nor an
        environment."""
        if not agent.enabled:
            return None
        return cls.from_names(
            agent.tools,
            dict(agent.environments) or agent.environment,
            tokenizer,
            format=agent.format,
            limits=AgentLimits(agent.max_turns, agent.max_tool_tokens, agent.tool_timeout_s),
            reward_weight=agent.environment_reward_weight,
        )

    @property
    def keeps_cache(self) -> bool:
        """Whether the sampler keeps each turn's KV cache: a later turn goes on from it."""
        return self.limits.max_turns > 1

    def _make_environment(self, name: str | None) -> object:
        factory = self.factories[name]
        try:
            return factory()
        except Exception as e:
            raise UserError(
                f"the environment factory {_name(factory)} raised {type(e).__name__}: {e}"
            ) from e

    def _toolbox(self, env: object | None) -> Toolbox:
        return Toolbox(self.functions, env, special_tokens=self.special_tokens)

    @property
    def share(self) -> RowShare:
        """Which rows' environments and calls this process runs."""
        if self._share is None:
            self._share = RowShare.of_processes()
        return self._share

    def environment_of(self, examples: Sequence[Mapping]) -> list[str | None]:
        """Each example's environment name (its ``environment`` column, with several
        environments; None with one or none).

        Raises:
          UserError: an example names no configured environment.
        """
        if not self.multi_environment:
            return [None] * len(examples)
        names = [ex.get("environment") for ex in examples]
        for i, name in enumerate(names):
            if name not in self.factories:
                raise UserError(
                    f"example {i} has environment={name!r}, which is none of the configured "
                    f"environments {sorted(self.factories)} (the example's 'environment' "
                    "column picks one)"
                )
        return names

    def prompt_tools(self, examples: Sequence[Mapping]) -> list[list[dict] | None] | None:
        """Per example, the schemas its prompt is rendered with (``tools=``: its environment's
        tools and the functions, None where it has none), or None where the chat template does
        not render tools (they are then in the system message)."""
        if not self.template_tools:
            return None
        return [self.tool_schemas[name] or None for name in self.environment_of(examples)]

    def start(
        self, examples: Sequence[Mapping], group: int
    ) -> tuple[list[list[dict]], list[Toolbox | None]]:
        """The B examples' prompt chats (the tools' description in the system message where
        the template does not render it, then what the environments' ``reset`` returned after
        the last user message) and B * G toolboxes, one per episode, each with a fresh
        environment reset with its example's row. With an environment, only the rows this
        process owns get one (and a toolbox; the others' are None): ``reset`` runs on each
        row's owner, and its text is sent to every process.

        Raises:
          UserError: an example names no configured environment; ``reset`` raised, returned
            something but a string or None, or returned different text for the episodes of
            one prompt (its G episodes share one prompt).
        """
        n_rows = len(examples) * group
        names = self.environment_of(examples)
        if not self.factories:
            texts, boxes = {}, [self._toolbox(None) for _ in range(n_rows)]
        else:
            envs: dict[int, object] = {}

            def reset(r: int) -> str | None:
                envs[r] = self._make_environment(names[r // group])
                row = reset_row(examples[r // group], multi_environment=self.multi_environment)
                return self._reset(envs[r], row, r // group)

            texts = self.share.map_rows(range(n_rows), n_rows, reset)
            boxes = [self._toolbox(envs[r]) if r in envs else None for r in range(n_rows)]
        chats = []
        for i, (example, name) in enumerate(zip(examples, names, strict=True)):
            group_texts = [texts[r] for r in range(i * group, (i + 1) * group) if r in texts]
            if len(set(group_texts)) > 1:
                env_name = self.environment_types[name].__name__
                raise UserError(
                    f"{env_name}.reset returned different text for the {group} episodes of "
                    f"example {i}; a prompt's group is sampled from one prompt, so reset's "
                    "text must depend on the example's columns only (seed any randomness "
                    "from them)"
                )
            messages = list(example["messages"])
            if self.instructions.get(name):
                messages = with_instructions(messages, self.instructions[name])
            chats.append(with_observation(messages, group_texts[0] if group_texts else None))
        return chats, boxes

    def _reset(self, env: object, row: Mapping, example: int) -> str | None:
        try:
            return reset_environment(env, row)
        except ToolError:
            raise
        except Exception as e:
            raise UserError(
                f"{type(env).__name__}.reset raised {type(e).__name__}: {e} (example {example})"
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
        if self.factories:
            n_rows = len(toolboxes)
            what = f"the {self.environment_name} environment"
            env = lambda r: toolboxes[r].environment  # noqa: E731
            envs = self.share.map_rows(range(n_rows), n_rows, env, what)
            batch.environments = [envs[r] for r in range(n_rows)]
        return batch

    def reward_functions(self) -> list[Callable[..., list]]:
        """The environments' ``get_reward()`` as reward functions over the ``environments``
        column, as TRL adds them: one per environment class that defines it, named after the
        class, scoring that class's episodes (None for the others'); none at weight 0."""
        if not self.reward_weight:
            return []
        out = []
        for env_type in self.reward_types:

            def score(environments, _type=env_type, **_):
                return [environment_reward(e) if type(e) is _type else None for e in environments]

            score.__name__ = score.__qualname__ = env_type.__name__
            out.append(score)
        return out


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
