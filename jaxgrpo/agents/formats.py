"""Tool-call formats: how a model writes a call, and how the call's result is written back.

A format owns three pieces of text, and nothing else (no tokenizer, no sampler):

- ``parse(text)``: the calls in the text of one model turn, as ``ToolCall``s. A call that is
  recognisably a call but cannot be read (bad JSON, no name, arguments that are not an object,
  an unclosed tag) is still returned, with ``error="malformed_call"``, so the rollout counts it
  and answers it with an error message like any failed call. Text with no call is a final answer:
  ``[]``.
- ``render_results([(name, text), ...])`` (``render_result`` for one): the text appended after
  the turn, i.e. what the model's chat template renders for the ``tool`` messages that answer
  the turn, up to and including the header of the next assistant turn. The rollout tokenizes it
  and appends it with loss mask 0.
- ``system_prompt(schemas)``: the block that tells the model its tools, for templates that do
  not render a ``tools=`` list themselves (with one that does, the prompt is rendered with
  ``tools=schemas``, as TRL renders it).

A chat template that renders tools also renders their results: built with ``render`` (the
template as a function), ``json`` and ``llama3`` write a turn's results as the template writes
its ``tool`` messages (``template_results``: the conversation rendered with and without them,
the difference after the calling turn's end), so the appended ids are those of TRL's tool loop
whatever the template's own layout. The hand-written renderings below are for templates that
know no tools (SmolLM2's ChatML).

Formats:

- ``json`` (jaxgrpo's default; Qwen2.5's and Qwen3's own): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, several per turn. Qwen2.5-Instruct's template renders an assistant turn
  with calls as ``...</tool_call><|im_end|>\\n`` and the ``tool`` messages that follow as one user
  turn, ``<|im_start|>user`` + ``\\n<tool_response>\\n{content}\\n</tool_response>`` per message +
  ``<|im_end|>\\n``, then the generation prompt ``<|im_start|>assistant\\n``. The model samples
  the ``<|im_end|>`` itself, so the appended text starts with the ``\\n`` that follows it. Works
  with any ChatML template (the system prompt then carries the ``<tools>`` block).
- ``llama3`` (Llama 3.1/3.2 JSON tool calls): the whole turn is ``{"name": ..., "parameters":
  {...}}`` (one call per turn: the template refuses more). The template renders a ``tool``
  message as ``<|start_header_id|>ipython<|end_header_id|>\\n\\n{content}<|eot_id|>`` right after
  the turn's ``<|eot_id|>``; it passes the content through ``tojson`` when it ``is mapping or
  is iterable``, which a string is in Jinja, so a string result is rendered as a JSON string
  literal (``17`` -> ``"17"``), as it is under TRL with that template.
- ``tag`` (for one-argument tools and small models): ``<calc>3*4+5</calc>``, answered by
  ``<result>17</result>`` appended right after the call inside the same assistant turn (no
  role tokens), so the model continues its own turn; the sampler stops at ``stop_strings``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from jaxgrpo.agents.schema import ToolError

MALFORMED = "malformed_call"
# A chat template as a function: (messages, add_generation_prompt) -> the text it renders.
Render = Callable[[list[dict], bool], str]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it.

    Attributes:
      name: the tool's name; None when it could not be read.
      arguments: the call's arguments; None when they could not be read.
      raw: the call's text as it appears in the turn (for logs and the conversational record).
      error: None, or ``"malformed_call"`` when the call could not be read.
      detail: why it could not be read, told to the model in the error message.
    """

    name: str | None
    arguments: dict | None
    raw: str
    error: str | None = None
    detail: str = ""


def _malformed(raw: str, detail: str, name: str | None = None) -> ToolCall:
    return ToolCall(name=name, arguments=None, raw=raw, error=MALFORMED, detail=detail)


def _json_call(raw: str, body: str, arguments_key: str) -> ToolCall:
    """A ``{"name": ..., <arguments_key>: {...}}`` object, or a malformed call saying why."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return _malformed(raw, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return _malformed(raw, "the call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _malformed(raw, 'the call has no "name" string')
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return _malformed(raw, f'"{arguments_key}" must be a JSON object', name=name)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _tool_lines(schemas: Iterable[Mapping]) -> str:
    return "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)


def template_results(
    render: Render, turn_ends: Sequence[str], results: Sequence[tuple[str, str]]
) -> str:
    """The text a chat template writes after a calling turn for its results: the ``tool``
    messages (``{"role": "tool", "name": ..., "content": ...}``, as TRL appends them) and the
    next generation prompt. It is the conversation rendered with them, after as many turn ends
    as the conversation without them has up to its calling turn's end (the model samples that
    end itself), which holds where a template renders the calling turn differently once it is
    no longer the last (Qwen3's empty reasoning block).

    Args:
      render: the chat template.
      turn_ends: the strings that end a turn (the tokenizer's end-of-turn tokens).
      results: (tool name, result text) per call of the turn.

    Raises:
      ToolError: the template does not end the calling turn with one of ``turn_ends``, or
        renders it with a different number of them once answered.
    """
    name = results[0][0] if results else ""
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    head = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    ends = re.compile("|".join(re.escape(t) for t in turn_ends if t) or "(?!)")
    before = render(head, False)
    marks = list(ends.finditer(before))
    if not marks or before[marks[-1].end() :].strip():
        raise ToolError("the chat template does not end a calling turn with an end-of-turn token")
    messages = [{"role": "tool", "name": n, "content": text} for n, text in results]
    full = render(head + messages, True)
    answered = list(ends.finditer(full))
    if len(answered) <= len(marks):
        raise ToolError("the chat template renders a calling turn differently once answered")
    return full[answered[len(marks) - 1].end() :]


class _ChatFormat:
    """A format whose results open a new turn: the chat template writes them when it can.

    Args:
      render: the chat template, when it renders tools (else the format's own layout).
      turn_ends: the tokenizer's end-of-turn strings (default: the format's ``turn_end``).
    """

    turn_end = ""

    def __init__(self, render: Render | None = None, turn_ends: Sequence[str] = ()):
        self.render = render
        self.turn_ends = tuple(turn_ends) or (self.turn_end,)

    def render_results(self, results: Sequence[tuple[str, str]]) -> str:
        if self.render is not None:
            return template_results(self.render, self.turn_ends, results)
        return self.own_results(results)

    def own_results(self, results: Sequence[tuple[str, str]]) -> str:
        raise NotImplementedError

    def render_result(self, name: str, text: str) -> str:
        return self.render_results([(name, text)])


class JsonFormat(_ChatFormat):
    """Qwen's ``<tool_call>`` JSON calls and ``<tool_response>`` results (ChatML)."""

    name = "json"
    turn_end = "<|im_end|>"  # the token that ends a turn; results follow it
    same_turn = False  # results open a new (user) turn
    _CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a turn early so a call can be answered: none (the turn ends)."""
        return ()

    def parse(self, text: str) -> list[ToolCall]:
        found = list(self._CALL_RE.finditer(text))
        calls = [_json_call(m.group(0), m.group(1), "arguments") for m in found]
        rest = text.find(self._OPEN, found[-1].end() if found else 0)
        if rest >= 0:  # a call cut off by the length limit, or never closed
            calls.append(_malformed(text[rest:], "the <tool_call> is never closed by </tool_call>"))
        return calls

    def own_results(self, results: Sequence[tuple[str, str]]) -> str:
        """Qwen2.5's layout, for a template that renders no ``tool`` messages."""
        body = "".join(f"\n<tool_response>\n{text}\n</tool_response>" for _, text in results)
        return f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n"

    def system_prompt(self, schemas: Sequence[Mapping]) -> str:
        """The ``# Tools`` block Qwen2.5's template appends to the system message."""
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tool_lines(schemas)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Llama3Format(_ChatFormat):
    """Llama 3.1/3.2 JSON calls (one per turn) and ``ipython`` results."""

    name = "llama3"
    turn_end = "<|eot_id|>"
    same_turn = False
    _ENDS = ("<|eot_id|>", "<|eom_id|>")

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def parse(self, text: str) -> list[ToolCall]:
        body = text.strip()
        for end in self._ENDS:
            body = body.removesuffix(end).rstrip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []  # prose: the final answer
        return [_json_call(text.strip(), body, "parameters")]

    def own_results(self, results: Sequence[tuple[str, str]]) -> str:
        """Llama 3.1's layout, for a template that renders no ``tool`` messages."""
        header = "<|start_header_id|>ipython<|end_header_id|>\n\n"
        body = "".join(
            f"{header}{json.dumps(text, ensure_ascii=False)}<|eot_id|>" for _, text in results
        )
        return f"{body}<|start_header_id|>assistant<|end_header_id|>\n\n"

    def system_prompt(self, schemas: Sequence[Mapping]) -> str:
        """The function list Llama 3.1's template puts in the system message when
        ``tools_in_user_message`` is false (its sentences run together, as the template's do)."""
        tools = "".join(json.dumps(s, ensure_ascii=False, indent=4) + "\n\n" for s in schemas)
        return (
            "You have access to the following functions. To call a function, please respond "
            "with JSON for a function call."
            'Respond in the format {"name": function name, "parameters": dictionary of argument '
            "name and its value}.Do not use variables.\n\n" + tools
        ).rstrip("\n")


class TagFormat:
    """``<tool>argument</tool>`` calls answered by ``<result>...</result>`` in the same turn.

    Args:
      params: each tool's name -> the name of its one argument (the tag's content).
    """

    name = "tag"
    turn_end = ""
    same_turn = True

    def __init__(self, params: Mapping[str, str]):
        self.params = dict(params)
        names = "|".join(re.escape(n) for n in self.params) or "(?!)"  # (?!): matches nothing
        self._call_re = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)
        self._open_re = re.compile(rf"<({names})>")

    def stop_strings(self) -> tuple[str, ...]:
        """The closing tags: the sampler stops there so the result can follow the call."""
        return tuple(f"</{n}>" for n in self.params)

    def parse(self, text: str) -> list[ToolCall]:
        calls, end = [], 0
        for m in self._call_re.finditer(text):
            name = m.group(1)
            calls.append(ToolCall(name, {self.params[name]: m.group(2).strip()}, m.group(0)))
            end = m.end()
        opened = self._open_re.search(text, end)
        if opened:
            detail = f"<{opened.group(1)}> is never closed by </{opened.group(1)}>"
            calls.append(_malformed(text[opened.start() :], detail, name=opened.group(1)))
        return calls

    def render_results(self, results: Sequence[tuple[str, str]]) -> str:
        return "".join(f"<result>{text}</result>" for _, text in results)

    def render_result(self, name: str, text: str) -> str:
        return self.render_results([(name, text)])

    def system_prompt(self, schemas: Sequence[Mapping]) -> str:
        lines = []
        for schema in schemas:
            fn = schema["function"]
            arg = self.params.get(fn["name"], next(iter(fn["parameters"]["properties"]), "input"))
            lines.append(f"<{fn['name']}>{arg}</{fn['name']}>: {fn['description']}")
        return (
            "You can use tools. To call one, write its name as a tag around its input:\n"
            + "\n".join(lines)
            + "\nThe result follows the call as <result>...</result>; then continue your answer."
        )


ToolFormat = JsonFormat | Llama3Format | TagFormat
FORMATS = ("json", "llama3", "tag")  # agent.format accepts these and "auto"


def detect_format(chat_template: str | None) -> str:
    """The format a chat template was built for (``agent.format = "auto"``): ``"json"`` when it
    mentions ``<tool_call>`` (Qwen), ``"llama3"`` for ``<|python_tag|>`` or ``ipython`` (Llama
    3.1/3.2), else ``"json"``, which works with any ChatML template."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "json"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "json"


def tag_params(schemas: Iterable[Mapping]) -> dict[str, str]:
    """Tool name -> its one argument, for the tag format; a tool with another count is refused."""
    params = {}
    for schema in schemas:
        fn = schema["function"]
        args = list(fn["parameters"]["properties"])
        if len(args) != 1:
            raise ToolError(
                f"tool {fn['name']!r} takes {len(args)} arguments; the tag format calls tools "
                'of exactly one (use agent.format = "json" for the others)'
            )
        params[fn["name"]] = args[0]
    return params


def get_format(
    kind: str,
    schemas: Sequence[Mapping] = (),
    chat_template: str | None = None,
    render: Render | None = None,
    turn_ends: Sequence[str] = (),
) -> ToolFormat:
    """The format named ``kind`` (one of ``FORMATS``, or ``"auto"``: ``detect_format``).

    Args:
      kind: ``agent.format``.
      schemas: the tools' schemas (the tag format reads each tool's one argument from them).
      chat_template: the tokenizer's chat template, read when ``kind`` is ``"auto"``.
      render: the chat template as a function, when it renders tools: ``json`` and ``llama3``
        then write results as it does (the tag format answers inside the turn, never).
      turn_ends: the tokenizer's end-of-turn strings, where ``render`` is given.
    """
    if kind == "auto":
        kind = detect_format(chat_template)
    if kind == "json":
        return JsonFormat(render, turn_ends)
    if kind == "llama3":
        return Llama3Format(render, turn_ends)
    if kind == "tag":
        return TagFormat(tag_params(schemas))
    raise ToolError(f"unknown tool-call format {kind!r}; formats: {', '.join(FORMATS)}, auto")
