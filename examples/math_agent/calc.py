"""A safe arithmetic evaluator for the agent's ``<calc>`` tool (ast-based, no eval).

Allowed: numbers (int/float literals), unary ``+ -``, binary ``+ - * / // % **``
and parentheses. Everything else (names, calls, attributes, subscripts, bools,
strings, comparisons …) is rejected. Bounds: expression length ≤ 200 characters,
≤ 100 AST nodes, integer exponents |e| ≤ 100, every intermediate |value| ≤ 1e15.

Light normalisation of what small models write: ``×``/``x`` between numbers → ``*``,
``÷`` → ``/``, ``^`` → ``**``, thousands commas and ``$`` removed, anything from the
first ``=`` on dropped (``"3*4 = "`` → ``3*4``).
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_LEN = 200
MAX_NODES = 100
MAX_EXP = 100
MAX_ABS = 10**15


class CalcError(ValueError):
    pass


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def normalise(expr: str) -> str:
    s = expr.strip()
    s = s.split("=", 1)[0]
    s = s.replace("×", "*").replace("÷", "/").replace("^", "**").replace("$", "")
    s = re.sub(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])", "*", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return s.strip()


def _check(v: int | float) -> int | float:
    if isinstance(v, complex):
        raise CalcError("complex result")
    if isinstance(v, float) and not math.isfinite(v):
        raise CalcError("result is not finite")
    if abs(v) > MAX_ABS:
        raise CalcError("result too large")
    return v


def _pow(a: int | float, b: int | float) -> int | float:
    if abs(b) > MAX_EXP:
        raise CalcError("exponent too large")
    if abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > math.log10(MAX_ABS):
        raise CalcError("result too large")
    if a == 0 and b < 0:
        raise CalcError("division by zero")
    return a**b


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CalcError(f"unsupported literal {v!r}")
        return _check(v)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _check(_UNOPS[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_pow(a, b))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise CalcError("division by zero")
        return _check(_BINOPS[type(node.op)](a, b))
    if isinstance(node, ast.Name):
        raise CalcError(f"names are not allowed: {node.id}")
    if isinstance(node, ast.Call):
        raise CalcError("function calls are not allowed")
    raise CalcError(f"unsupported syntax: {type(node).__name__}")


def safe_eval(expr: str) -> int | float:
    """Evaluate ``expr``; raise :class:`CalcError` on anything not allowed."""
    if not isinstance(expr, str):
        raise CalcError("expression must be a string")
    s = normalise(expr)
    if not s:
        raise CalcError("empty expression")
    if len(s) > MAX_LEN:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(s, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError("invalid expression") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError("expression too complex")
    try:
        return _eval(tree)
    except CalcError:
        raise
    except (ArithmeticError, ValueError, TypeError, RecursionError) as e:
        raise CalcError(str(e) or type(e).__name__) from e


def format_number(v: int | float) -> str:
    """Integers exactly; floats rounded to 10 decimals, integral floats without ``.0``."""
    if isinstance(v, int):
        return str(v)
    r = round(v, 10)
    if r == int(r):
        return str(int(r))
    return format(r, ".10f").rstrip("0").rstrip(".")


def calculate(expr: str) -> str:
    """The tool: the formatted result, or ``"error: <reason>"`` (never raises)."""
    try:
        return format_number(safe_eval(expr))
    except CalcError as e:
        return f"error: {e}"
