"""``agents.calculator.calc``: arithmetic through an ``ast`` whitelist, numbers written as a
person writes them, and an ``Error: ...`` line for anything else."""

from __future__ import annotations

import time

import pytest

from jaxgrpo.agents.calculator import calc
from jaxgrpo.agents.schema import tool_schema


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("3*4+5", "17"),
        ("5/2", "2.5"),
        ("6/3", "2"),
        ("(1+2)*-3", "-9"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        (" 0.1 + 0.2 ", "0.3"),
        ("1/3", "0.333333333333"),
        ("1e20", "1e+20"),
        ("+7 - -3", "10"),
    ],
)
def test_arithmetic(expression, expected):
    assert calc(expression) == expected


@pytest.mark.parametrize(
    "expression, error",
    [
        ("1/0", "Error: division by zero"),
        ("0**-1", "Error: division by zero"),
        ("3*", "Error: invalid expression '3*'"),
        ("x+1", "Error: the name 'x' is not allowed"),
        ("__import__('os')", "Error: Call is not allowed"),
        ("(1).real", "Error: Attribute is not allowed"),
        ("True+1", "Error: Constant is not allowed"),
        ("7 % 2", "Error: the operator Mod is not allowed"),
        ("9**9**9", "Error: the result is too large"),
        ("10.0**400", "Error: the result is too large"),
        ("(-8)**0.5", "Error: the result is not a real number"),
        ("(" * 300 + "1" + ")" * 300, "Error: the expression is longer than 200 characters"),
    ],
)
def test_errors_are_lines_the_model_reads(expression, error):
    t0 = time.perf_counter()
    assert calc(expression).startswith(error)
    assert time.perf_counter() - t0 < 0.5, "refused before computing"


def test_calc_is_a_well_described_tool():
    fn = tool_schema(calc)["function"]
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["description"] == "Evaluates an arithmetic expression."
