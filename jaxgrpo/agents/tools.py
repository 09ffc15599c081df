"""The tools of one rollout, and the call that never raises.

A ``Toolbox`` holds TRL's two kinds of tools: stateless functions (``GRPOTrainer(tools=[...])``)
and the public methods of an environment instance (``environment_factory``: one instance per
rollout, so its methods share that rollout's state). Each tool's schema is built once, at
construction (``schema.tool_schema``), so a tool the model could never be told about fails
before anything is sampled.

``Toolbox.call`` runs a call the model wrote and always returns a ``ToolResult``: whatever goes
wrong becomes an error message the model reads as the tool's result, and an error kind the
rollout counts (``ERROR_KINDS``). Arguments are checked against the schema before the call, so
a wrong-typed argument is the model's mistake ("bad_arguments"), not the tool's ("raised").
The call runs on the calling thread under ``rewards.limits.bounded``'s watchdog, which
interrupts it past ``timeout_s`` (on the main thread only: elsewhere it runs unbounded).

A result is ``str(value)`` (``json.dumps`` for a dict, list or tuple). One larger than
``max_result_chars`` is refused ("oversized") before anyone tokenizes it; cutting a result to
``max_tool_tokens`` happens later, on token ids, in the rollout. A result that contains one of the
tokenizer's special-token strings is refused ("control_tokens"): tokenized with special tokens
parsed, ``<|im_end|>`` in a web page would end the turn for the model.

Environments (TRL's contract): ``reset(**columns)`` starts an episode and returns None or a
string appended to the last user message (``reset_environment``); ``get_reward()`` scores the
finished episode, logged under the class's name (``environment_reward``); every other public
method is a tool (``environment_tools``).

``TOOLS`` names the built-in tools (``calc``, ``python``) that a config may list by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence

from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.formats import ToolCall
from jaxgrpo.agents.python_tool import python
from jaxgrpo.agents.schema import ToolError, signature_line, tool_schema
from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded

ERROR_KINDS = (
    "malformed_call",  # the call could not be read (bad JSON, no name, unclosed tag)
    "unknown_tool",  # no tool by that name
    "bad_arguments",  # missing, unexpected or wrong-typed arguments
    "raised",  # the tool raised an exception
    "timeout",  # the tool ran past timeout_s
    "oversized",  # the result is longer than max_result_chars
    "control_tokens",  # the result contains a special-token string
)
TOOLS: dict[str, Callable] = {"calc": calc, "python": python}
"""The built-in tools, by the name a config's ``agent.tools`` may use instead of a dotted path."""
ENVIRONMENT_METHODS = ("reset", "get_reward")  # an environment's methods that are not tools
_MAX_ERROR_CHARS = 500  # an exception's message is cut to this in the model's error text


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What the model reads back for one call.

    Attributes:
      text: the tool's result, or the error message that replaces it.
      error: None, or one of ``ERROR_KINDS``.
    """

    text: str
    error: str | None = None


def contains_control_tokens(text: str, special_tokens: Iterable[str]) -> bool:
    """Whether ``text`` contains any of the tokenizer's special-token strings."""
    return any(token and token in text for token in special_tokens)


def result_text(value: object) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def environment_tools(env: object) -> list[Callable]:
    """The environment's tools: its public methods (bound), but ``reset`` and ``get_reward``,
    in definition order, the most derived class first."""
    seen: set[str] = set()
    tools = []
    for cls in type(env).__mro__[:-1]:  # [:-1]: not object's
        for name, attr in vars(cls).items():
            if name.startswith("_") or name in ENVIRONMENT_METHODS or name in seen:
                continue
            seen.add(name)  # a subclass's attribute hides a base class's method
            if inspect.isfunction(attr) or isinstance(attr, staticmethod | classmethod):
                tools.append(getattr(env, name))
    return tools


def reset_environment(env: object, columns: Mapping[str, object]) -> str | None:
    """Calls ``env.reset`` with the example's columns (those it accepts, all with ``**kwargs``)
    and returns what it returned: None, or text to append to the last user message."""
    reset = getattr(env, "reset", None)
    if reset is None:
        return None
    params = inspect.signature(reset).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = dict(columns)
    else:
        kwargs = {k: v for k, v in columns.items() if k in params}
    text = reset(**kwargs)
    if text is not None and not isinstance(text, str):
        raise ToolError(
            f"{type(env).__name__}.reset returned a {type(text).__name__}; it must return None "
            "or a string (appended to the last user message)"
        )
    return text


def environment_reward(env: object) -> float | None:
    """``env.get_reward()`` as a float (None: the environment has no ``get_reward``, or it
    cannot score this episode). Logged under ``type(env).__name__``."""
    get_reward = getattr(env, "get_reward", None)
    if get_reward is None:
        return None
    value = get_reward()
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolError(
            f"{type(env).__name__}.get_reward returned a {type(value).__name__}; it must "
            "return a number (or None)"
        )
    return float(value)


_JSON_TYPES: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def matches(value: object, spec: Mapping) -> bool:
    """Whether a JSON value fits a ``schema.tool_schema`` property (types, items, enum)."""
    if value is None and spec.get("nullable"):
        return True
    if "anyOf" in spec:
        return any(matches(value, s) for s in spec["anyOf"])
    if "enum" in spec and not any(type(e) is type(value) and e == value for e in spec["enum"]):
        return False
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
        return False
    if isinstance(value, list) and "items" in spec:
        return all(matches(v, spec["items"]) for v in value)
    if isinstance(value, dict) and "additionalProperties" in spec:
        return all(matches(v, spec["additionalProperties"]) for v in value.values())
    return True


def argument_problem(schema: Mapping, arguments: Mapping, accepts_extra: bool) -> str | None:
    """What is wrong with a call's arguments against the tool's schema, or None."""
    params = schema["function"]["parameters"]
    properties = params["properties"]
    missing = [a for a in params.get("required", ()) if a not in arguments]
    extra = [a for a in arguments if a not in properties]
    wrong = [a for a, v in arguments.items() if a in properties and not matches(v, properties[a])]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(map(repr, missing))}")
    if extra and not accepts_extra:
        problems.append(f"unexpected {', '.join(map(repr, extra))}")
    for a in wrong:
        kind = properties[a].get("type", "a value of its schema")
        problems.append(f"{a!r} must be {kind}, not {json.dumps(arguments[a])[:80]}")
    return "; ".join(problems) or None


class Toolbox:
    """The tools one rollout may call: functions, an environment's methods, or both.

    Args:
      functions: stateless tool functions (TRL's ``tools=[...]``).
      environment: an environment instance whose public methods are tools (``environment_tools``).
      special_tokens: the tokenizer's special-token strings; a result containing one is refused.
      max_result_chars: a longer result is refused ("oversized").
    """

    def __init__(
        self,
        functions: Sequence[Callable] = (),
        environment: object | None = None,
        *,
        special_tokens: Iterable[str] = (),
        max_result_chars: int = 100_000,
    ):
        tools = [*functions, *(environment_tools(environment) if environment is not None else ())]
        self._fns: dict[str, Callable] = {}
        self._schemas: dict[str, dict] = {}
        self._accepts_extra: dict[str, bool] = {}
        for fn in tools:
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self._fns:
                raise ToolError(f"two tools are named {name!r}; tool names must be unique")
            self._fns[name], self._schemas[name] = fn, schema
            params = inspect.signature(fn).parameters.values()
            self._accepts_extra[name] = any(p.kind is p.VAR_KEYWORD for p in params)
        self.environment = environment
        self.special_tokens = tuple(t for t in special_tokens if t)
        self.max_result_chars = max_result_chars

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    @property
    def schemas(self) -> list[dict]:
        """The tools' schemas, in order: what the system prompt or ``tools=`` lists."""
        return list(self._schemas.values())

    def _error(self, kind: str, message: str) -> ToolResult:
        # The message quotes the model's own text (a tool name, an argument) and exception
        # messages: it must not smuggle a control token into the episode either.
        for token in self.special_tokens:
            message = message.replace(token, f"{token[:1]} {token[1:]}")
        return ToolResult(f"Error: {message}", kind)

    def run(self, call: ToolCall, timeout_s: float) -> ToolResult:
        """``call`` for a parsed ``ToolCall``; a malformed one is answered with why."""
        if call.error is not None:
            return self._error(call.error, f"could not read the tool call: {call.detail}")
        return self.call(call.name, call.arguments, timeout_s)

    def call(self, name: str, arguments: dict, timeout_s: float) -> ToolResult:
        """Runs tool ``name`` with ``arguments``; every failure is a ``ToolResult`` with an error.

        Args:
          name: the tool's name as the model wrote it.
          arguments: the arguments as the model wrote them (a JSON object).
          timeout_s: wall-time limit of the call; <= 0: none.
        """
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return self._error(
                "malformed_call", "a tool call needs a name and a JSON object of arguments"
            )
        fn = self._fns.get(name)
        if fn is None:
            return self._error(
                "unknown_tool", f"unknown tool {name!r}; tools: {', '.join(self.names)}"
            )
        problem = argument_problem(self._schemas[name], arguments, self._accepts_extra[name])
        if problem:
            usage = signature_line(self._schemas[name])
            return self._error(
                "bad_arguments", f"bad arguments for {name!r}: {problem}; call {usage}"
            )
        try:
            with bounded(timeout_s):
                value = fn(**arguments)
            text = result_text(value)
        except RewardLimitExceeded:
            return self._error("timeout", f"tool {name!r} took longer than {timeout_s:g} s")
        except Exception as e:
            what = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
            return self._error("raised", f"tool {name!r} raised {what}")
        if len(text) > self.max_result_chars:
            return self._error(
                "oversized",
                f"tool {name!r} returned {len(text)} characters, more than the "
                f"{self.max_result_chars} allowed",
            )
        found = next((t for t in self.special_tokens if t in text), None)
        if found is not None:
            return self._error(
                "control_tokens",
                f"tool {name!r} returned text containing the control token {found!r}",
            )
        return ToolResult(text)
