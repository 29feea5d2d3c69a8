"""What one request's constraint may cost, and the checks made on its text before compiling.

A grammar engine compiles a constraint by recursion over its rules and schemas: llguidance
overflowed an 8 MB thread stack at about 2,500 chained Lark rules, 2,500 chained `$ref`s, or 800
objects each holding the next (its native code then takes the whole process down). Compiles
therefore run on a thread with a COMPILE_STACK_BYTES stack (structured/workers.py), and these
limits keep every accepted constraint far inside it (measured: a chained rule takes about 2 KB
of stack, a nested schema level about 5 KB, so 5,000 rules or 1,000 nested schemas stay under a
sixth of it; the JSON schemas in a Lark grammar's `%json` are checked as schemas). Time is
bounded twice: the compile with its first mask (workers.py), and the masks of every step
(manager.py)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..errors import ConstraintError, InvalidRequestError

COMPILE_STACK_BYTES = 64 << 20  # virtual: only the pages a compile touches become resident


@dataclass(frozen=True)
class ConstraintLimits:
    max_rules: int = 5_000  # rule definitions in a Lark or GBNF grammar
    max_schema_depth: int = 1_000  # subschemas nested along one path of a JSON schema, each $ref a level
    max_grammar_symbols: int = 100_000  # llguidance's grammar size (its max_grammar_size)
    compile_seconds: float = 10.0  # compiling and the first mask, wall clock
    # Masks: the first, at compile time (this thread's CPU time, so that load elsewhere does not
    # count), and each step's, all rows together (wall clock: what the other rows of the batch wait).
    first_mask_seconds: float = 0.2
    mask_budget_seconds: float = 0.2

    @classmethod
    def of(cls, value: ConstraintLimits | dict | None) -> ConstraintLimits:
        """From EngineConfig's field: the limits, a dict of some of them (`--structured-outputs-config`), or None."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            raise InvalidRequestError("structured outputs' limits must be a JSON object", "constraint_limits")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(f"unknown structured-output limits: {', '.join(sorted(unknown))} "
                                      f"(known: {', '.join(cls.__dataclass_fields__)})", "constraint_limits")
        for k, v in value.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise InvalidRequestError(f"structured-output limit {k} must be a positive number", "constraint_limits")
        return cls(**value)

    def check_lark(self, text: str, param: str) -> None:
        n = lark_rule_count(text)
        if n > self.max_rules:
            raise ConstraintError(f"the grammar defines {n} rules; the limit is {self.max_rules}", param,
                                  code="constraint_too_large")
        decoder = json.JSONDecoder()
        for m in _LARK_JSON.finditer(text):
            try:
                schema, _ = decoder.raw_decode(text, m.end())
            except (ValueError, RecursionError):
                continue  # not JSON: the grammar engine says so
            self.check_schema(schema, param)

    def check_schema(self, schema: Any, param: str) -> None:
        depth = schema_depth(schema, self.max_schema_depth)
        if depth > self.max_schema_depth:
            raise ConstraintError(f"the JSON schema nests more than {self.max_schema_depth} subschemas deep "
                                  f"(counting each $ref)", param, code="constraint_too_large")


_LARK_JSON = re.compile(r"%json\s*")
_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:")


def lark_rule_count(text: str) -> int:
    """Rule and terminal definitions (`name:` at the start of a line)."""
    return sum(1 for _ in _LARK_RULE.finditer(text))


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "not",
               "if", "then", "else", "additionalItems", "unevaluatedItems")


def _children(schema: dict, root: Any) -> list:
    out = []
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            out.extend(v for v in value.values() if isinstance(v, dict))
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            out.extend(v for v in value if isinstance(v, dict))
    for key in _SUBSCHEMAS:
        value = schema.get(key)
        if isinstance(value, dict):
            out.append(value)
        elif isinstance(value, list):  # old-style tuple "items"
            out.extend(v for v in value if isinstance(v, dict))
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, dict):
            out.append(target)
    return out


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer ("#", "#/$defs/a", "#/properties/x~1y"); anything else: None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any, stop_above: int) -> int:
    """The longest chain of nested subschemas (a $ref is one more level, a cycle is not followed),
    by an iterative depth-first walk that remembers each subschema's depth: linear in the
    schema's size. Stops once past `stop_above`."""
    if not isinstance(schema, dict):
        return 0
    depth: dict[int, int] = {}  # id(subschema) -> its depth, once known
    on_path: set[int] = set()
    stack: list[tuple[dict, list | None]] = [(schema, None)]
    keep = []  # the subschemas walked, so that their ids stay theirs
    while stack:
        node, children = stack[-1]
        if children is None:  # first visit
            on_path.add(id(node))
            keep.append(node)
            children = [c for c in _children(node, schema) if id(c) not in on_path]
            stack[-1] = (node, children)
            if len(stack) > stop_above:
                return len(stack)
        while children and id(children[-1]) in depth:
            children.pop()
        if children:
            stack.append((children.pop(), None))
            continue
        stack.pop()
        on_path.discard(id(node))
        depth[id(node)] = 1 + max((depth.get(id(c), 0) for c in _children(node, schema)
                                   if id(c) not in on_path), default=0)
        if depth[id(node)] > stop_above:
            return depth[id(node)]
    return depth[id(schema)]
