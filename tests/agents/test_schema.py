"""``agents.schema.tool_schema``: a tool written as a TRL user writes it gets the schema
``transformers.utils.get_json_schema`` gives it, and a function it cannot describe is refused with
one error naming the function and the argument."""

from __future__ import annotations

from typing import Literal, Optional

import pytest

from jaxgrpo.agents.schema import ToolError, parse_docstring, signature_line, tool_schema


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """
    Gets the current weather in a city.

    Args:
        city: The city to look up,
            e.g. Paris.
        unit: The unit of the temperature.

    Returns:
        The weather, as one sentence.
    """
    return f"Sunny in {city}"


GET_WEATHER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to look up, e.g. Paris."},
                "unit": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "description": "The unit of the temperature.",
                },
            },
            "required": ["city"],
        },
        "return": {"type": "string", "description": "The weather, as one sentence."},
    },
}


def many_types(
    n: int,
    x: float,
    flag: bool,
    tags: list[str],
    weights: dict[str, float],
    maybe: Optional[int] = None,  # noqa: UP045 (the spelling TRL users write)
    either: int | None = None,
    size: str = "m",
):
    """Uses every supported hint.

    Args:
        n: A count.
        x (float): A number, with its type in parentheses.
        flag: A switch.
        tags: Some labels.
        weights: Label weights.
        maybe: An optional count.
        either: Another optional count.
        size: A size (choices: ["s", "m", "l"])
    """


def test_a_trl_style_tool_gets_the_documented_schema():
    assert tool_schema(get_weather) == GET_WEATHER_SCHEMA


def test_the_schema_equals_transformers_get_json_schema():
    """The same dict, key order included, so the tool renders into a prompt as under TRL."""
    utils = pytest.importorskip("transformers.utils")
    for fn in (get_weather, many_types):
        ours, theirs = tool_schema(fn), utils.get_json_schema(fn)
        assert ours == theirs and repr(ours) == repr(theirs), fn.__name__


def test_every_supported_hint_converts():
    props = tool_schema(many_types)["function"]["parameters"]["properties"]
    assert props["n"]["type"] == "integer" and props["x"]["type"] == "number"
    assert props["x"]["description"] == "A number, with its type in parentheses."
    assert props["flag"]["type"] == "boolean"
    assert props["tags"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": "Some labels.",
    }
    assert props["weights"]["additionalProperties"] == {"type": "number"}
    assert props["maybe"] == {
        "type": "integer",
        "nullable": True,
        "description": "An optional count.",
    }
    assert props["either"]["nullable"] is True
    assert props["size"] == {"type": "string", "enum": ["s", "m", "l"], "description": "A size"}
    assert tool_schema(many_types)["function"]["parameters"]["required"] == [
        "n",
        "x",
        "flag",
        "tags",
        "weights",
    ]


def test_a_method_is_described_without_self():
    class Env:
        def move(self, steps: int) -> str:
            """Moves.

            Args:
                steps: How far.
            """

    schema = tool_schema(Env().move)
    assert list(schema["function"]["parameters"]["properties"]) == ["steps"]
    assert signature_line(schema) == "move(steps: integer)"


def test_an_argument_without_a_hint_is_named_in_the_error():
    def search(query, limit: int = 3) -> str:
        """Searches.

        Args:
            query: What to look for.
            limit: How many results.
        """

    with pytest.raises(ToolError, match=r"tool 'search', argument 'query' has no type hint"):
        tool_schema(search)


def test_an_undocumented_argument_is_named_in_the_error():
    def search(query: str, limit: int = 3) -> str:
        """Searches.

        Args:
            query: What to look for.
        """

    with pytest.raises(ToolError, match=r"tool 'search', argument 'limit' is not described"):
        tool_schema(search)


class Point:
    """A type with no JSON form."""


def test_a_function_without_a_docstring_or_with_an_unconvertible_hint_is_refused():
    def bare(x: int):
        pass

    def plot(p: Point):
        """Plots.

        Args:
            p: The point.
        """

    with pytest.raises(ToolError, match="'bare' has no docstring"):
        tool_schema(bare)
    with pytest.raises(ToolError, match=r"tool 'plot', argument 'p'.*no JSON form"):
        tool_schema(plot)
    assert issubclass(ToolError, TypeError)


def test_the_docstring_sections_split():
    description, args, returns = parse_docstring(get_weather.__doc__)
    assert description == "Gets the current weather in a city."
    assert args == {
        "city": "The city to look up, e.g. Paris.",
        "unit": "The unit of the temperature.",
    }
    assert returns == "The weather, as one sentence."
