"""The tools of one rollout, and the call that never raises.

A ``Toolbox`` holds TRL's two kinds of tools: stateless functions (``GRPOTrainer(tools=[...])``)
and the public methods of an environment instance (``environment_factory``: one instance per
rollout, so its methods share that rollout's state). Each tool's schema is built once, at
construction (``schema.tool_schema``), so a tool the model could never be told about fails
before anything is sampled. A tool is named by its ``__name__``.

``Toolbox.run_all`` runs the calls of one turn as TRL's tool loop does and always returns one
``ToolResult`` per call: whatever goes wrong becomes the error text TRL gives the model
(``str({"error": ...})``: ``{'error': 'Tool foo not found.'}`` for an unknown tool, the
exception's ``str`` for one the tool raised) and an error kind the rollout counts
(``ERROR_KINDS``). The arguments are passed as the model wrote them (``fn(**arguments)``), with
no check or conversion against the schema: a string where an ``int`` was hinted reaches the tool,
and what the tool does with it is the tool's. A call whose arguments do not fit the signature
(missing, unexpected) raises Python's ``TypeError``, reported as TRL reports it and counted as
"bad_arguments". A tool may word its own failure for the model (``schema.FailedResult``: the
``python`` tool's traceback line): the text is the result as it is, and the call counts as
failed.

Sync tools run one after another under ``rewards.limits.bounded_call``, whose watchdog stops
one past ``timeout_s`` on any thread (off the main thread, one blocked in C code is left behind
at its limit). ``async def`` tools are awaited: the turn's coroutines run concurrently on one
event loop (``core.aio.gather``), each bounded by ``timeout_s`` on any thread.

A result is ``str(value)``, as TRL writes a non-string result into the ``tool`` message (a list
of ``{"type": "text", "text": ...}`` content blocks is its texts, joined). One larger than
``max_result_chars`` is refused ("oversized") before anyone tokenizes it; cutting a result to
``max_tool_tokens`` happens later, on token ids, in the rollout. A result that contains one of the
tokenizer's special-token strings is refused ("control_tokens"): tokenized with special tokens
parsed, ``<|im_end|>`` in a web page would end the turn for the model.

Environments (TRL's contract): ``reset(**row)`` gets the example's row (``reset_row``: ``prompt``
and every other column) and returns None or a string appended to the last user message
(``reset_environment``); ``get_reward()`` scores the finished episode, logged under the class's
name (``environment_reward``); ``reset``, ``get_reward`` and an ``async def`` of either are
awaited. Every other public function of the class is a tool (``environment_tools``, in TRL's
order: by name).

``TOOLS`` names the built-in tools (``calc``, ``python``) that a config may list by name.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.formats import ToolCall
from jaxgrpo.agents.python_tool import python
from jaxgrpo.agents.schema import FailedResult, ToolError, tool_schema
from jaxgrpo.core import aio
from jaxgrpo.data.base import CHAT_ROW
from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded_call

ERROR_KINDS = (
    "malformed_call",  # the call could not be read (bad JSON, no name, unclosed tag)
    "unknown_tool",  # no tool by that name
    "bad_arguments",  # the arguments do not fit the tool's signature (missing, unexpected)
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
      text: the tool's result, or the error text that replaces it (``{'error': '...'}``).
      error: None, or one of ``ERROR_KINDS``.
    """

    text: str
    error: str | None = None


def contains_control_tokens(text: str, special_tokens: Iterable[str]) -> bool:
    """Whether ``text`` contains any of the tokenizer's special-token strings."""
    return any(token and token in text for token in special_tokens)


def result_text(value: object) -> str:
    """A tool's return value as the ``tool`` message's text: ``str(value)``, or the texts of a
    list of ``{"type": "text", "text": ...}`` content blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_text_block(v) for v in value):
        return "".join(v["text"] for v in value)
    return str(value)


def _is_text_block(value: object) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and "text" in value


def environment_tools(env: object) -> list[Callable]:
    """The environment's tools as TRL lists them: the functions of its class (inherited ones
    included, by name) that are public and not ``reset`` or ``get_reward``, bound to ``env``."""
    members = inspect.getmembers(type(env), predicate=inspect.isfunction)
    return [
        getattr(env, name)
        for name, _ in members
        if not name.startswith("_") and name not in ENVIRONMENT_METHODS
    ]


def reset_row(example: Mapping[str, object], *, multi_environment: bool = False) -> dict:
    """The example as the dataset row TRL passes to ``reset(**row)``: ``prompt`` is the
    example's chat (jaxgrpo's ``messages``, the list of messages TRL's conversational ``prompt``
    holds), then every other column but jaxgrpo's ``CHAT_ROW`` mark; with several
    environments, without ``environment`` (the column that picks one, which TRL does not
    forward)."""
    row: dict = {}
    if "messages" in example:
        row["prompt"] = [dict(m) for m in example["messages"]]
    for key, value in example.items():
        dropped = key in ("messages", CHAT_ROW) or (multi_environment and key == "environment")
        if not dropped:
            row.setdefault(key, value)
    return row


def reset_environment(env: object, row: Mapping[str, object]) -> str | None:
    """Calls (and awaits) ``env.reset`` with the example's row (``reset_row``; the columns
    its signature accepts, all of them when it takes ``**kwargs``) and returns what it returned:
    None, or text to append to the last user message."""
    reset = getattr(env, "reset", None)
    if reset is None:
        return None
    params = inspect.signature(reset).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = dict(row)
    else:
        kwargs = {k: v for k, v in row.items() if k in params}
    text = aio.resolve(reset(**kwargs))
    if text is not None and not isinstance(text, str):
        raise ToolError(
            f"{type(env).__name__}.reset returned a {type(text).__name__}; it must return None "
            "or a string (appended to the last user message)"
        )
    return text


def environment_reward(env: object) -> float | None:
    """``env.get_reward()`` (awaited when it is ``async def``) as a float (None: the environment
    has no ``get_reward``, or it cannot score this episode). Logged under
    ``type(env).__name__``."""
    get_reward = getattr(env, "get_reward", None)
    if get_reward is None:
        return None
    value = aio.resolve(get_reward())
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolError(
            f"{type(env).__name__}.get_reward returned a {type(value).__name__}; it must "
            "return a number (or None)"
        )
    return float(value)


def _fits(fn: Callable, arguments: Mapping) -> bool:
    """Whether ``fn(**arguments)`` binds (a mismatch is the model's mistake, not the tool's)."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call tell
        return True
    return True


class Toolbox:
    """The tools one rollout may call: functions, an environment's methods, or both.

    Args:
      functions: stateless tool functions (TRL's ``tools=[...]``), sync or ``async def``.
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
        for fn in tools:
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self._fns:
                raise ToolError(f"two tools are named {name!r}; tool names must be unique")
            self._fns[name], self._schemas[name] = fn, schema
        self.environment = environment
        self.special_tokens = tuple(t for t in special_tokens if t)
        self.max_result_chars = max_result_chars

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    @property
    def schemas(self) -> list[dict]:
        """The tools' schemas, in order: what ``tools=`` or the system prompt lists."""
        return list(self._schemas.values())

    def _error(self, kind: str, message: str) -> ToolResult:
        # The message quotes the model's own text (a tool name, an argument) and exception
        # messages: it must not smuggle a control token into the episode either.
        for token in self.special_tokens:
            message = message.replace(token, f"{token[:1]} {token[1:]}")
        return ToolResult(str({"error": message}), kind)

    def run(self, call: ToolCall, timeout_s: float) -> ToolResult:
        """``run_all`` for one call."""
        return self.run_all([call], timeout_s)[0]

    def call(self, name: str, arguments: dict, timeout_s: float) -> ToolResult:
        """Runs tool ``name`` with ``arguments`` as the model wrote them (a JSON object);
        ``timeout_s``: wall-time limit of the call (<= 0: none). Never raises."""
        return self.run(ToolCall(name, arguments, ""), timeout_s)

    def run_all(self, calls: Sequence[ToolCall], timeout_s: float) -> list[ToolResult]:
        """The results of one turn's ``calls``, in order: the sync ones run one by one, then
        the ``async def`` ones concurrently, each bounded by ``timeout_s`` (<= 0: none); a
        malformed call is answered with why it could not be read. Never raises."""
        results: list[ToolResult | None] = []
        pending: list[tuple[int, str, Awaitable]] = []  # (index, tool, its coroutine)
        for call in calls:
            started = self._start(call, timeout_s)
            if isinstance(started, ToolResult):
                results.append(started)
            else:
                pending.append((len(results), call.name, started))
                results.append(None)
        values = aio.gather([coroutine for _, _, coroutine in pending], timeout_s)
        for (i, name, _), value in zip(pending, values, strict=True):
            results[i] = self._finish(name, value, timeout_s)
        return results

    def _start(self, call: ToolCall, timeout_s: float) -> ToolResult | Awaitable:
        """A sync call's result, or an async call's coroutine (not yet awaited)."""
        if call.error is not None:
            return self._error(call.error, f"could not read the tool call: {call.detail}")
        name, arguments = call.name, call.arguments
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return self._error(
                "malformed_call", "a tool call needs a name and a JSON object of arguments"
            )
        fn = self._fns.get(name)
        if fn is None:
            return self._error("unknown_tool", f"Tool {name} not found.")
        try:
            value = bounded_call(lambda: fn(**arguments), timeout_s)
        except RewardLimitExceeded:
            value = aio.LimitExceeded()
        except Exception as e:
            value = e if _fits(fn, arguments) else _BadArguments(e)
        if inspect.isawaitable(value):
            return value
        return self._finish(name, value, timeout_s)

    def _finish(self, name: str, value: object, timeout_s: float) -> ToolResult:
        """The ``ToolResult`` of a call that returned (or raised) ``value``."""
        if isinstance(value, aio.LimitExceeded):
            return self._error("timeout", f"Tool {name} timed out after {timeout_s:g} s.")
        if isinstance(value, _BadArguments):
            return self._error("bad_arguments", str(value.error)[:_MAX_ERROR_CHARS])
        if isinstance(value, BaseException):  # TRL's message: the exception's str
            return self._error("raised", str(value)[:_MAX_ERROR_CHARS])
        text = result_text(value)
        failed = value.kind if isinstance(value, FailedResult) else None
        if len(text) > self.max_result_chars:
            return self._error(
                "oversized",
                f"Tool {name} returned {len(text)} characters, more than the "
                f"{self.max_result_chars} allowed.",
            )
        found = next((t for t in self.special_tokens if t in text), None)
        if found is not None:
            return self._error(
                "control_tokens",
                f"Tool {name} returned text containing the control token {found!r}.",
            )
        return ToolResult(str(text), failed)


@dataclasses.dataclass(frozen=True)
class _BadArguments:
    """The ``TypeError`` of a call whose arguments do not fit the tool's signature."""

    error: Exception
