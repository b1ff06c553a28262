"""The calculator tool: a small, bounded arithmetic evaluator.

nanochat runs the model's expression with `eval` under `signal.alarm`. That is unsafe, and the
alarm only works on the main thread (a Ray replica runs model work elsewhere, so the tool silently
never answered). Here the expression is parsed with `ast` and walked by hand: numbers, + - * /,
unary signs, parentheses, and `'text'.count('x')`. Operand, result and nesting sizes are bounded, so
nothing can run long and no timeout is needed. Anything else returns None (the model gets no output).
"""
from __future__ import annotations

import ast
import math

MAX_EXPR_CHARS = 256
MAX_DEPTH = 32
MAX_ABS = 10 ** 15
MAX_STRING = 1000


class _Refused(Exception):
    pass


def _number(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Refused("not a number")
    if isinstance(x, float) and not math.isfinite(x):
        raise _Refused("not finite")
    if abs(x) > MAX_ABS:
        raise _Refused("too large")
    return x


def _eval(node: ast.AST, depth: int):
    if depth > MAX_DEPTH:
        raise _Refused("too deep")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            if len(node.value) > MAX_STRING:
                raise _Refused("string too long")
            return node.value
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _number(_eval(node.operand, depth + 1))
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a = _number(_eval(node.left, depth + 1))
        b = _number(_eval(node.right, depth + 1))
        if isinstance(node.op, ast.Add):
            return _number(a + b)
        if isinstance(node.op, ast.Sub):
            return _number(a - b)
        if isinstance(node.op, ast.Mult):
            return _number(a * b)   # operands <= 1e15, so the product is computed instantly, then bounded
        if b == 0:
            raise _Refused("division by zero")
        return _number(a / b)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and len(node.args) == 1 and not node.keywords):
        text, needle = _eval(node.func.value, depth + 1), _eval(node.args[0], depth + 1)
        if not isinstance(text, str) or not isinstance(needle, str):
            raise _Refused(".count needs strings")
        return text.count(needle)
    raise _Refused(f"{type(node).__name__} is not allowed")


def use_calculator(expr: str) -> int | float | None:
    """Evaluate the model's expression; None when it is refused or invalid."""
    expr = expr.strip()
    if not expr or len(expr) > MAX_EXPR_CHARS:
        return None
    if "'" not in expr and '"' not in expr:
        expr = expr.replace(",", "")   # "1,234 + 5" as nanochat allows
    try:
        tree = ast.parse(expr, mode="eval")
        value = _eval(tree.body, 0)
    except (_Refused, SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    if isinstance(value, str):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def format_result(value: int | float) -> str:
    if isinstance(value, float):
        return repr(round(value, 10))
    return str(value)
