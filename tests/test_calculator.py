"""The calculator tool: nanochat's answers on normal input, and None, fast, on hostile input."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanoinfer.tools import CALCULATOR, TOOLS, Tool, use_calculator

NORMAL = [
    ("1 + 2", 3), ("2+3*4", 14), ("(2+3)*4", 20), ("7/2", 3.5), ("10-4-3", 3), ("-5+2", -3),
    ("3.5*2", 7.0), ("0.1+0.2", 0.1 + 0.2), ("1,000*3", 3000), ("1,234,567 + 1", 1234568),
    ("7//2", 3), ("+4", 4), (" 4 ", 4), ("3.", 3.0), (".5+1", 1.5), ("-" * 900 + "1", 1),
    ("+".join(["1"] * 500), 500), ("1*(" * 150 + "1" + ")" * 150, 1),
    ("99999999999*99999999999", 99999999999 ** 2),
    ('"strawberry".count("r")', 3), ("'hello world'.count('o')", 2), ('"a,b,c".count(",")', 4),
    ('("banana").count("an")', 2), ('"x.count(y"', "x.count(y"),
]

HOSTILE = [
    "9**9**9", "2**10", "*".join(["99999999999"] * 500), "(" * 5000 + "1" + ")" * 5000,
    "(" * 300 + "1" + ")" * 300, "().__class__", "().__class__.__bases__[0].__subclasses__()",
    '"".__class__.count("a")', "lambda: 1", "(lambda x: x)(1)", "[x for x in range(10)]",
    "{1: 2}", '"a" * 10**9', '"aaa".count("a") + 1', '"a".upper().count("A")', "x.count('a')",
    '"' + "a" * 100_000 + '".count("a")', "٣+1", "３*2", "1/0", "1//0", "", "   ", "import os",
    "__import__('os').system('echo hi')", "x", "open('/etc/passwd').read()", '"open".count("o")',
    'getattr("", "count")("a")', "1e5", "1 2", "0123", "2 % 3", "1;2", "1 if 1 else 2",
    "print(1)", "True", "None", '"abc".count(x)', '"abc".count("a" "b")[0]', "1\n+2", "\t1",
]


@pytest.mark.parametrize("expr, expected", NORMAL)
def test_normal_arithmetic_and_count(expr, expected):
    got = use_calculator(expr)
    assert got == expected and type(got) is type(expected)


def test_matches_python_on_random_expressions():
    rng = random.Random(0)

    def expr(depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([str(rng.randint(0, 999)), f"{rng.randint(0, 99)}.{rng.randint(0, 99)}"])
        if rng.random() < 0.15:
            return f"-({expr(depth - 1)})"
        return f"{expr(depth - 1)} {rng.choice('+-*/')} ({expr(depth - 1)})"

    for _ in range(300):
        text = expr(4)
        try:
            want = eval(text, {"__builtins__": {}})  # the oracle: what nanochat computes
        except ZeroDivisionError:
            want = None
        assert use_calculator(text) == want, text


def _timed(expr: str) -> tuple[object, float]:
    start = time.monotonic()
    return use_calculator(expr), time.monotonic() - start


@pytest.mark.parametrize("expr", HOSTILE, ids=[repr(e[:30]) for e in HOSTILE])
def test_hostile_input_is_rejected_fast(expr):
    result, seconds = _timed(expr)
    assert result is None
    assert seconds < 1.0


def test_hostile_input_from_worker_threads():
    # no SIGALRM anywhere: the same rules and limits hold off the main thread
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda e: (_timed(e), threading.current_thread() is threading.main_thread()),
                                HOSTILE * 2))
    for ((result, seconds), on_main) in results:
        assert result is None and seconds < 1.0 and not on_main
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(use_calculator, [e for e, _ in NORMAL])) == [v for _, v in NORMAL]


def test_non_string_input():
    assert use_calculator(None) is None  # type: ignore[arg-type]
    assert use_calculator(b"1+1") is None  # type: ignore[arg-type]


def test_tool_registry():
    assert isinstance(CALCULATOR, Tool) and TOOLS["calculator"] is CALCULATOR
    assert (CALCULATOR.start_token, CALCULATOR.end_token) == ("<|python_start|>", "<|python_end|>")
    assert CALCULATOR.fn("2+3*4") == "14"  # nanochat inserts str(result)
    assert CALCULATOR.fn("7/2") == "3.5"
    assert CALCULATOR.fn('"strawberry".count("r")') == "3"
    assert CALCULATOR.fn("import os") is None
