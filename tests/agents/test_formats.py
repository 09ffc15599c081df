"""``agents.formats``: each format reads the calls of one turn (several, malformed ones counted)
and renders results as its chat template renders the ``tool`` messages that answer the turn."""

from __future__ import annotations

import json

import pytest

from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.formats import (
    JsonFormat,
    Llama3Format,
    TagFormat,
    ToolCall,
    detect_format,
    get_format,
)
from jaxgrpo.agents.schema import ToolError, tool_schema


def two_args(a: int, b: int) -> int:
    """Adds.

    Args:
        a: One.
        b: Two.
    """
    return a + b


CALC = tool_schema(calc)


def test_json_reads_several_calls_in_one_turn():
    text = (
        "Let me compute both.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "3*4"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "née", "limit": 2}}</tool_call>'
    )
    calls = JsonFormat().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calc", {"expression": "3*4"}, None),
        ("search", {"query": "née", "limit": 2}, None),
    ]
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")
    assert JsonFormat().parse("The answer is 17.") == []


def test_json_malformed_calls_are_returned_with_the_reason():
    fmt = JsonFormat()
    bad_json, no_name, bad_args = fmt.parse(
        '<tool_call>{"name": "calc", "arguments": {</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "3*4"}</tool_call>'
    )
    assert bad_json.error == "malformed_call" and "not valid JSON" in bad_json.detail
    assert no_name.error == "malformed_call" and 'no "name"' in no_name.detail
    assert bad_args == ToolCall(
        "calc", None, bad_args.raw, "malformed_call", '"arguments" must be a JSON object'
    )
    (unclosed,) = fmt.parse('Sure. <tool_call>{"name": "calc", "argu')
    assert unclosed.error == "malformed_call" and "never closed" in unclosed.detail


def test_json_renders_results_as_qwen25s_template_renders_tool_messages():
    """Qwen2.5-Instruct's template ends an assistant turn with calls by ``'<|im_end|>\\n'`` (the
    model samples the ``<|im_end|>``), opens ``'<|im_start|>user'`` before the first of a run of
    ``tool`` messages, writes ``'\\n<tool_response>\\n' + content + '\\n</tool_response>'`` for
    each and ``'<|im_end|>\\n'`` after the last; then the generation prompt
    ``'<|im_start|>assistant\\n'``."""
    fmt = JsonFormat()
    assert fmt.render_result("calc", "17") == (
        "\n<|im_start|>user\n<tool_response>\n17\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fmt.render_results([("calc", "12"), ("search", "none")]) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response>"
        "\n<tool_response>\nnone\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.turn_end == "<|im_end|>" and not fmt.same_turn and fmt.stop_strings() == ()


def test_json_system_prompt_lists_the_schemas_inside_tools():
    prompt = JsonFormat().system_prompt([CALC])
    assert prompt.startswith("# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{json.dumps(CALC, ensure_ascii=False)}\n</tools>" in prompt
    assert prompt.endswith(
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_llama3_reads_the_turns_json_object():
    fmt = Llama3Format()
    (call,) = fmt.parse('{"name": "calc", "parameters": {"expression": "3*4"}}<|eot_id|>')
    assert (call.name, call.arguments, call.error) == ("calc", {"expression": "3*4"}, None)
    (tagged,) = fmt.parse('<|python_tag|>{"name": "calc", "parameters": {"expression": "1"}}')
    assert tagged.arguments == {"expression": "1"}
    assert fmt.parse("The answer is 12.") == []
    (broken,) = fmt.parse('{"name": "calc", "parameters": {"expression": ')
    assert broken.error == "malformed_call"


def test_llama3_renders_results_as_llama31s_template_renders_tool_messages():
    """Llama 3.1's template writes a ``tool`` message as
    ``"<|start_header_id|>ipython<|end_header_id|>\\n\\n"``, then ``message.content | tojson`` when
    the content ``is mapping or is iterable`` (a string is iterable in Jinja), then
    ``"<|eot_id|>"``; the generation prompt is
    ``'<|start_header_id|>assistant<|end_header_id|>\\n\\n'``."""
    assert Llama3Format().render_result("calc", "17") == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"17"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    prompt = Llama3Format().system_prompt([CALC])
    assert json.dumps(CALC, indent=4) in prompt and "Do not use variables." in prompt


def test_tag_reads_calls_of_its_tools_only_and_answers_in_the_same_turn():
    fmt = get_format("tag", [CALC])
    assert isinstance(fmt, TagFormat) and fmt.stop_strings() == ("</calc>",)
    (call,) = fmt.parse("First, <calc> 3*4+5 </calc>")
    assert call == ToolCall("calc", {"expression": "3*4+5"}, "<calc> 3*4+5 </calc>")
    assert fmt.parse("<answer>17</answer>") == []
    two = fmt.parse("<calc>1+1</calc> and <calc>2*3</calc>")
    assert [c.arguments["expression"] for c in two] == ["1+1", "2*3"]
    closed, unclosed = fmt.parse("<calc>1+1</calc> then <calc>2*")
    assert closed.error is None and unclosed.raw == "<calc>2*"
    assert unclosed.error == "malformed_call" and unclosed.name == "calc"
    assert fmt.render_result("calc", "17") == "<result>17</result>" and fmt.same_turn
    assert "<calc>expression</calc>: Evaluates an arithmetic expression." in fmt.system_prompt(
        [CALC]
    )


def test_the_tag_format_refuses_a_tool_without_exactly_one_argument():
    with pytest.raises(ToolError, match="'two_args' takes 2 arguments"):
        get_format("tag", [CALC, tool_schema(two_args)])
    with pytest.raises(ToolError, match="unknown tool-call format 'xml'"):
        get_format("xml")


def test_detect_format():
    qwen = '{%- if tools %}...<tool_call>\\n{"name": <function-name>...{%- endif %}'
    llama = '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}...{% endfor %}"
    assert detect_format(qwen) == "json"
    assert detect_format(llama) == "llama3" and detect_format("<|python_tag|>") == "llama3"
    assert detect_format(chatml) == "json" and detect_format(None) == "json"
    assert isinstance(get_format("auto", chat_template=llama), Llama3Format)
