"""The calculator tool: nanochat's acceptance rules, evaluated without `eval`.

nanochat runs `eval` with empty builtins under SIGALRM. Here the expression is parsed with
`ast` and walked by hand over a small whitelist of node types, so nothing but arithmetic and
`str.count` can run at all. Every operand is bounded (input length, integer size, tree
depth), so each node is cheap, and the walker checks a `time.monotonic` deadline at every
node: the 3-second limit works from any thread on any OS, no signals involved.
"""
from __future__ import annotations

import ast
import operator
import string
import time
from collections.abc import Callable
from dataclasses import dataclass

TIME_LIMIT_S = 3.0
MAX_EXPR_CHARS = 1000  # longer inputs are rejected before parsing: parse time stays tiny
MAX_INT_BITS = 4096  # ~1233 decimal digits: a product of two such ints is still instant
MAX_DEPTH = 200  # parenthesised nesting like 1*(2*(3*(...))); the parser itself stops at 200 parentheses

_ARITH_CHARS = frozenset("0123456789+-*/.() ")
# ASCII only: str.isalnum() would let through '٣' or '３', which Python happily parses as digits
_STRING_CHARS = frozenset(string.ascii_letters + string.digits + "'\"()._ ")
_FORBIDDEN = ("__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input",
              "globals", "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr")

# `//` passes the character filter (two slashes), and nanochat's eval computes it, so it is here too
_BINOPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}
_UNARYOPS: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Rejected(Exception):
    """The expression is outside what the calculator evaluates."""


def use_calculator(expr: str) -> int | float | str | None:
    """Evaluate `expr` under nanochat's rules; None when rejected, on any error, or past 3 s."""
    if not isinstance(expr, str):
        return None
    expr = expr.replace(",", "")
    if len(expr) > MAX_EXPR_CHARS:
        return None
    if all(c in _ARITH_CHARS for c in expr):
        if "**" in expr:
            return None
        string_path = False
    elif all(c in _STRING_CHARS for c in expr):
        lowered = expr.lower()
        if any(bad in lowered for bad in _FORBIDDEN) or ".count(" not in expr:
            return None
        string_path = True
    else:
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        walker = _Walker(time.monotonic() + TIME_LIMIT_S)
        return walker.count(tree.body) if string_path else walker.number(tree.body, 0)
    except Exception:  # _Rejected, SyntaxError, ZeroDivisionError, OverflowError, RecursionError, ...
        return None


@dataclass
class _Walker:
    deadline: float

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Rejected("time limit")

    def number(self, node: ast.AST, depth: int) -> int | float:
        """Arithmetic path: int/float constants, + - * / // and unary + -."""
        self.tick()
        if depth > MAX_DEPTH:
            raise _Rejected("nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            # 1+2+3+... nests to the left as deep as it is long: fold such chains in a loop,
            # so only parenthesised nesting on the right costs recursion depth
            chain = []
            while isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                chain.append(node)
                node = node.left
            value = self.number(node, depth + 1)
            for op_node in reversed(chain):
                self.tick()
                right = self.number(op_node.right, depth + 1)
                value = _bounded(_BINOPS[type(op_node.op)](value, right))
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
            ops = []
            while isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
                ops.append(node.op)
                node = node.operand
            value = self.number(node, depth + 1)
            for op in reversed(ops):
                value = _UNARYOPS[type(op)](value)
            return value
        raise _Rejected(type(node).__name__)

    def count(self, node: ast.AST) -> int | str:
        """String path: `"text".count("sub")`. (Commas are already gone, so only one argument.)"""
        self.tick()
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value  # e.g. 'a.count(b' is just a string literal; eval returns it too
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
                and len(node.args) == 1 and not node.keywords):
            raise _Rejected("only a str constant's .count(str constant)")
        receiver, arg = node.func.value, node.args[0]
        if not all(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in (receiver, arg)):
            raise _Rejected("only a str constant's .count(str constant)")
        return receiver.value.count(arg.value)


def _bounded(value: int | float) -> int | float:
    # Defence in depth: with inputs capped at MAX_EXPR_CHARS no product can get this big, but if
    # the limits change, capping every intermediate still keeps each step instant
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _Rejected("integer too large")
    return value


@dataclass(frozen=True)
class Tool:
    """A tool the model calls by emitting `start_token expr end_token`; fn returns the text that
    the engine then forces into the output between output_start and output_end."""
    name: str
    start_token: str
    end_token: str
    fn: Callable[[str], str | None]
    output_start: str = "<|output_start|>"
    output_end: str = "<|output_end|>"


def _calculator_fn(expr: str) -> str | None:
    value = use_calculator(expr)
    return None if value is None else str(value)  # nanochat inserts str(result)


CALCULATOR = Tool("calculator", "<|python_start|>", "<|python_end|>", _calculator_fn)
TOOLS: dict[str, Tool] = {CALCULATOR.name: CALCULATOR}
