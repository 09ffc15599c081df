"""``calc``: the arithmetic tool the tool-use study ships, safe to hand to a sampled model.

The expression is parsed with ``ast`` and walked over a whitelist (numbers, ``+ - * / **``,
unary signs, parentheses); nothing is ever ``eval``-ed, so a model cannot reach names, calls or
attributes. Inputs that could hold the process (``9**9**9``, a long string of parentheses) are
refused by size before they are computed. Every failure raises ``CalcError`` saying what is
wrong: the toolbox answers the call with that message, which the model reads, and counts the
call as failed (``agent/failed/raised``), so a bad expression costs the model a turn rather
than the run, and shows in the metrics rather than passing for a result.
"""

from __future__ import annotations

import ast
import math
import operator

_MAX_CHARS = 200  # longer expressions are refused before parsing (deep nesting)
_MAX_BITS = 4096  # an integer result past this many bits is refused (the size of 9**9**9)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression calc refuses; the message says why (what the model reads)."""


def _power(base: float, exponent: float) -> float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if abs(base) > 1 and exponent * math.log2(abs(base)) > _MAX_BITS:
            raise CalcError("the result is too large")
    try:
        value = base**exponent
    except OverflowError:
        raise CalcError("the result is too large") from None
    except ZeroDivisionError:  # 0 ** -1
        raise CalcError("division by zero") from None
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    return value


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        value = _OPS[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > _MAX_BITS:
            raise CalcError("the result is too large")
        return value
    if isinstance(node, ast.Name):
        found = f"the name {node.id!r}"
    elif isinstance(node, ast.BinOp | ast.UnaryOp):
        found = f"the operator {type(node.op).__name__}"
    else:
        found = type(node).__name__
    raise CalcError(f"{found} is not allowed (only numbers, + - * / ** and parentheses)")


def format_number(value: float) -> str:
    """``17`` for integral values (no trailing ``.0``), else up to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def calc(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression, with numbers, + - * / ** and parentheses, e.g. 3*4+5.

    Returns:
        The value, e.g. 17 or 2.5.

    Raises:
        CalcError: the expression is invalid or its value cannot be given.
    """
    if len(expression) > _MAX_CHARS:
        raise CalcError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError(f"invalid expression {expression.strip()!r}") from None
    try:
        return format_number(_evaluate(tree))
    except (OverflowError, RecursionError):
        raise CalcError("the result is too large") from None
