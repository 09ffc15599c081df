"""The JSON schema of a tool: what the model is told about a Python function it may call.

A tool is written the way TRL's ``GRPOTrainer(tools=[...])`` and ``transformers``'
``get_json_schema`` expect it: type hints on every argument and a Google-style docstring whose
first part describes the function and whose ``Args:`` section describes each argument::

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        \"\"\"Gets the current weather in a city.

        Args:
            city: The city to look up.
            unit: The unit of the temperature.
        \"\"\"

``tool_schema`` turns it into the OpenAI/Hugging Face function schema that chat templates render
into the system prompt (Qwen's ``<tools>`` block, Llama 3.1's function list)::

    {"type": "function", "function": {"name": "get_weather", "description": "...",
     "parameters": {"type": "object", "properties": {"city": {"type": "string",
     "description": "The city to look up."}, ...}, "required": ["city"]}, "return": {...}}}

The dict has the keys, key order and conventions of ``transformers.utils.get_json_schema`` (an
optional argument is ``"nullable": true``; ``required`` is left out when empty; a ``return``
entry when the return hint converts; ``(choices: [...])`` at the end of an argument's
description becomes an ``enum``), so a tool renders into the prompt as it does under TRL. As
under TRL, the model's arguments are not checked against it: they reach the tool as written.

A function the schema cannot describe (an argument without a hint or without a description, a
hint that has no JSON form) is refused at construction with one ``ToolError`` naming the
function and the argument, before anything is sampled.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from jaxgrpo.core.errors import UserError

# Docstring section headers that end the description or the Args section (Google style).
_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?|Warnings?):\s*$"
)
_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^()]*\))?\s*:\s*(.*)$")  # "name (type): text"
_CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_SCALARS: dict[Any, dict[str, str]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}
_JSON_TYPE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
SUPPORTED_HINTS = "str, int, float, bool, list[...], dict, Literal[...], Optional[X] / X | None"


class ToolError(UserError, TypeError):
    """A function or environment that cannot serve as a tool; the message names the function
    (and the argument) and says what to change."""


class FailedResult(str):
    """A tool's result that words the tool's own failure (a program that raised or ran out
    of time): the model reads the text as it is, and the rollout counts the call as failed
    with ``kind`` (one of ``tools.ERROR_KINDS``). Called directly, the tool returns text."""

    kind: str

    def __new__(cls, text: str, kind: str = "raised") -> FailedResult:
        result = super().__new__(cls, text)
        result.kind = kind
        return result


def _callable_name(fn: Callable) -> str:
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ToolError(f"a tool must be a named function or method, not {fn!r}")
    return name


def _hint_schema(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint; ``where`` names the function and argument for errors."""
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if not args or any(type(a) not in _JSON_TYPE for a in args):
            raise ToolError(f"{where}: Literal values must be str, int, float, bool or None")
        kinds = list(dict.fromkeys(_JSON_TYPE[type(a)] for a in args))
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        parts = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            kinds = sorted({p["type"] for p in parts})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is list:
        return (
            {"type": "array", "items": _hint_schema(args[0], where)} if args else {"type": "array"}
        )
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint_schema(args[1], where)
        return out
    raise ToolError(f"{where}: the type hint {hint!r} has no JSON form; use {SUPPORTED_HINTS}")


def parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """Splits a Google-style docstring into (description, {argument: description}, returns).

    The description is the text before the first section header; an argument's description is
    its ``name:`` (or ``name (type):``) line plus its more-indented continuation lines, joined
    by spaces.
    """
    lines = inspect.cleandoc(doc).splitlines()
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in lines:
        header = _SECTION_RE.match(line.strip())
        if header and not line.startswith((" ", "\t")):
            current = header.group(1).lower()
            sections[current] = []
        else:
            sections[current].append(line)
    description = "\n".join(sections[""]).strip()
    arg_lines = next(
        (sections[k] for k in ("args", "arguments", "parameters") if k in sections), []
    )
    args: dict[str, str] = {}
    indent, name = None, None
    for line in arg_lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        entry = _ARG_RE.match(line.strip())
        if entry and (indent is None or depth <= indent):
            indent, name = depth, entry.group(1).lstrip("*")
            args[name] = entry.group(2).strip()
        elif name is not None:
            args[name] = f"{args[name]} {line.strip()}".strip()
    returns = next((sections[k] for k in ("returns", "return") if k in sections), None)
    returns_text = "\n".join(returns).strip() if returns is not None else None
    return description, args, returns_text or None


def _describe(schema: dict, text: str) -> dict:
    """Adds the argument's description, turning a trailing ``(choices: [...])`` into ``enum``."""
    choices = _CHOICES_RE.search(text)
    if choices:
        try:
            schema["enum"] = json.loads(choices.group(1))
            text = text[: choices.start()].strip()
        except json.JSONDecodeError:
            pass  # not a JSON list: the text stays part of the description
    schema["description"] = text
    return schema


def tool_schema(fn: Callable) -> dict:
    """The OpenAI/Hugging Face function schema of ``fn`` (a function or a bound method).

    Args:
      fn: the tool; every argument (but ``self``, ``*args`` and ``**kwargs``) needs a type hint
        and a line in the docstring's ``Args:`` section.

    Returns:
      ``{"type": "function", "function": {"name", "description", "parameters", ["return"]}}``
      where ``parameters`` is ``{"type": "object", "properties": {...}, ["required": [...]]}``.

    Raises:
      ToolError: naming the function and the argument the schema cannot describe.
    """
    name = _callable_name(fn)
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolError(
            f"tool {name!r} has no docstring: a tool needs one (a description, then an Args: "
            "section describing each argument) so the model knows what it does"
        )
    description, arg_docs, returns_doc = parse_docstring(doc)
    try:
        hints = typing.get_type_hints(target)
    except Exception as e:  # an annotation naming something undefined
        raise ToolError(f"tool {name!r}: its type hints do not resolve ({e})") from None
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        where = f"tool {name!r}, argument {param.name!r}"
        if param.name not in hints:
            raise ToolError(f"{where} has no type hint; use {SUPPORTED_HINTS}")
        if param.name not in arg_docs:
            raise ToolError(f"{where} is not described in the docstring's Args: section")
        properties[param.name] = _describe(
            _hint_schema(hints[param.name], where), arg_docs[param.name]
        )
        if param.default is param.empty:
            required.append(param.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:  # the model never writes the return value: a hint with no JSON form is left out
            function["return"] = _hint_schema(hints["return"], f"tool {name!r}, return")
        except ToolError:
            pass
        else:
            if returns_doc is not None:
                function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}


def signature_line(schema: dict) -> str:
    """``name(arg: type, [opt: type])``: a tool's call shape in one line, for error messages."""
    fn = schema["function"]
    required = set(fn["parameters"].get("required", ()))
    parts = []
    for arg, spec in fn["parameters"]["properties"].items():
        kind = spec.get("type", "any")
        kind = " | ".join(kind) if isinstance(kind, list) else kind
        if "enum" in spec:
            kind = " | ".join(json.dumps(v) for v in spec["enum"])
        parts.append(f"{arg}: {kind}" if arg in required else f"[{arg}: {kind}]")
    return f"{fn['name']}({', '.join(parts)})"
