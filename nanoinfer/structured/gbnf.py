"""GBNF (llama.cpp's grammar format) to Lark (llguidance's), in time linear in the grammar.

The output is the Lark that llguidance's own converter (`llguidance.gbnf_to_lark`) writes for
the same grammar: rules in their order, `root` renamed `start`, names in Lark's spelling, and
every rule whose references all end in terminals written as a terminal (UPPERCASE), which
llguidance lexes instead of parsing. That converter decides terminals by re-scanning every rule
until nothing changes (quadratic in a chain of rules) and parses by recursion; this one uses a
worklist and an explicit stack, and refuses more than MAX_NESTING nested groups.

    rule   ::= name "::=" alternatives  (ends at a newline outside parentheses)
    item   ::= "literal" | [class] | name | ( alternatives ) | .   then  * + ? {m} {m,} {m,n}
    # comments run to the end of the line (kept, as // comments, above the next rule)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NESTING = 64  # parenthesised groups inside one another


class GbnfError(ValueError):
    pass


@dataclass
class _Rule:
    name: str
    body: tuple  # a node: see _str
    comment: str
    order: int
    terminal: bool = False


# nodes: ("lit", text) ("rx", text) ("ref", name) ("rep", node, min, max) ("seq", [nodes]) ("alt", [nodes])
_NAME = re.compile(r"[^\W]|[-_]", re.UNICODE)
_NAME_RUN = re.compile(r"(?:\w|-)+")
_INT = re.compile(r"[0-9]+")
_HEX = set("0123456789abcdefABCDEF")
_ESCAPES = {"x": 2, "u": 4, "U": 8}


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, {text[max(0, pos - 20):pos]!r} ^ {text[pos:pos + 20]!r}"


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos, self.comment = text, 0, []

    def fail(self, message: str) -> GbnfError:
        return GbnfError(f"{message} at {_where(self.text, self.pos)}")

    def cur(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_space(self, newlines: bool) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t":
                self.pos += 1
            elif newlines and c in "\r\n":
                self.pos += 2 if text.startswith("\r\n", self.pos) else 1
            elif c == "#":
                end = self.pos + 1
                while end < n and text[end] not in "\r\n":
                    end += 1
                self.comment.append("//" + text[self.pos + 1:end] + "\n")
                self.pos = end
            else:
                return

    def char(self) -> str:
        """One character of a literal or class, escapes kept as written (\\u without leading zeros)."""
        text, pos = self.text, self.pos
        if pos >= len(text):
            raise self.fail("Unexpected end of input")
        c = text[pos]
        if c != "\\":
            self.pos += 1
            return c
        if pos + 1 >= len(text):
            raise self.fail("Incomplete escape sequence")
        e = text[pos + 1]
        self.pos = pos + 1
        if e in '"\\[]nrt':
            self.pos += 1
            return "\\" + e
        if e in _ESCAPES:
            digits = text[pos + 2:pos + 2 + _ESCAPES[e]]
            if len(digits) != _ESCAPES[e] or not set(digits) <= _HEX:
                raise self.fail(f"Invalid \\{e} escape sequence: \\{e}{digits}")
            self.pos = pos + 2 + _ESCAPES[e]
            return f"\\{e}{digits if e == 'x' else digits.lstrip('0')}"
        raise self.fail(f"Invalid escape sequence \\{e}")

    def literal(self) -> tuple:
        self.pos += 1
        out = []
        while (c := self.char()) != '"':
            out.append(c)
        return ("lit", "".join(out))

    def char_class(self) -> tuple:
        self.pos += 1
        out = ["["]
        while True:
            c = self.char()
            out.append("\\" + c if c in "/[" else c)
            if c == "]":
                return ("rx", "".join(out))

    def name(self) -> str:
        m = _NAME_RUN.match(self.text, self.pos)
        if m is None:
            raise self.fail("Expected name")
        self.pos = m.end()
        return m.group()

    def integer(self) -> int:
        m = _INT.match(self.text, self.pos)
        if m is None:
            raise self.fail("Expected integer")
        self.pos = m.end()
        return int(m.group())

    def repetition(self, nodes: list) -> None:
        c = self.cur()
        if not nodes or not c or c not in "*+?{":
            return
        self.pos += 1
        if c != "{":
            nodes[-1] = ("rep", nodes[-1], *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            return
        self.skip_space(True)
        low = self.integer()
        self.skip_space(True)
        if self.cur() == "}":
            self.pos += 1
            nodes[-1] = ("rep", nodes[-1], low, low)
            return
        if self.cur() != ",":
            raise self.fail("Expected ',' or '}'")
        self.pos += 1
        self.skip_space(True)
        high = self.integer() if self.cur().isdigit() else None
        self.skip_space(True)
        if self.cur() != "}":
            raise self.fail("Expected '}'")
        self.pos += 1
        nodes[-1] = ("rep", nodes[-1], low, high)

    def alternatives(self) -> tuple:
        """A rule's body: groups by an explicit stack of (alternatives, current sequence) frames."""
        frames: list[tuple[list, list]] = [([], [])]
        while True:
            nested = len(frames) > 1
            alts, seq = frames[-1]
            c = self.cur()
            if c and c not in "|)" and (nested or c not in "\r\n"):
                if c == "(":
                    if len(frames) > MAX_NESTING:
                        raise self.fail(f"groups nested more than {MAX_NESTING} deep")
                    self.pos += 1
                    self.skip_space(True)
                    frames.append(([], []))
                    continue
                if c == '"':
                    seq.append(self.literal())
                elif c == "[":
                    seq.append(self.char_class())
                elif c == ".":
                    self.pos += 1
                    seq.append(("rx", "."))
                elif _NAME.match(c):
                    seq.append(("ref", self.name()))
                else:  # not an item: the sequence ends here
                    c = ""
                if c:
                    self.after_item(seq, nested)
                    continue
            # the sequence ended
            alts.append(("seq", seq))
            self.skip_space(nested)
            if self.cur() == "|":
                self.pos += 1
                self.skip_space(True)
                frames[-1] = (alts, [])
                continue
            group = ("alt", alts)
            if not nested:
                return group
            if self.cur() != ")":
                raise self.fail("Expected ')'")
            self.pos += 1
            frames.pop()
            self.skip_space(len(frames) > 1)
            outer = frames[-1][1]
            outer.append(group)
            self.after_item(outer, len(frames) > 1, skip_first=False)

    def after_item(self, seq: list, nested: bool, skip_first: bool = True) -> None:
        if skip_first:
            self.skip_space(nested)
        self.repetition(seq)
        self.skip_space(nested)

    def rules(self, max_rules: int) -> dict[str, _Rule]:
        rules: dict[str, _Rule] = {}
        self.skip_space(True)
        while self.cur():
            name = self.name()
            self.skip_space(False)
            if not self.text.startswith("::=", self.pos):
                raise self.fail("Expected ::=")
            self.pos += 3
            self.skip_space(True)
            body = self.alternatives()
            if self.cur() in "\r\n" and self.cur():
                self.pos += 2 if self.text.startswith("\r\n", self.pos) else 1
            rules[name] = _Rule(name, _simplify(body), "".join(self.comment), len(rules))
            self.comment = []
            if len(rules) > max_rules:
                raise GbnfError(f"the grammar has more than {max_rules} rules")
            self.skip_space(True)
        return rules


def _simplify(node: tuple) -> tuple:
    """A sequence or alternation of one item is that item (bottom-up, as the reference converter)."""
    kind = node[0]
    if kind == "rep":
        return ("rep", _simplify(node[1]), node[2], node[3])
    if kind in ("seq", "alt"):
        items = [_simplify(n) for n in node[1]]
        return items[0] if len(items) == 1 else (kind, items)
    return node


def _refs(node: tuple, out: list) -> list:
    stack = [node]
    while stack:
        n = stack.pop()
        if n[0] == "ref":
            out.append(n[1])
        elif n[0] == "rep":
            stack.append(n[1])
        elif n[0] in ("seq", "alt"):
            stack.extend(n[1])
    return out


def _str(node: tuple, names: dict[str, str], top: bool = False) -> str:
    kind = node[0]
    if kind == "lit":
        return f'"{node[1]}"'
    if kind == "rx":
        return f"/{node[1]}/"
    if kind == "ref":
        return names[node[1]]
    if kind == "seq":
        return " ".join(_str(n, names) for n in node[1]) if node[1] else '""'
    if kind == "alt":
        inner = [_str(n, names) for n in node[1]]
        return "\n     | ".join(inner) if top else "(" + " | ".join(inner) + ")"
    _, inner_node, low, high = node
    inner = _str(inner_node, names)
    if inner_node[0] in ("seq", "alt"):
        inner = f"({inner})"
    if (low, high) == (0, None):
        return inner + "*"
    if (low, high) == (1, None):
        return inner + "+"
    if (low, high) == (0, 1):
        return inner + "?"
    return f"{inner}{{{low},{'' if high is None else high}}}"


def gbnf_to_lark(text: str, max_rules: int = 1 << 30) -> str:
    rules = _Parser(text).rules(max_rules)
    refs = {name: _refs(r.body, []) for name, r in rules.items()}
    for targets in refs.values():
        for t in targets:
            if t not in rules:
                raise GbnfError(f"Rule '{t}' not found")
    if "root" not in rules:
        raise GbnfError("No 'root' rule found")
    if "start" in rules:
        raise GbnfError("Rule 'start' already exists")
    # Terminals: rules (not root) all of whose references are terminals, found by a worklist
    # (each rule waits on a count of references still unresolved).
    waiting = {name: len(targets) for name, targets in refs.items()}
    users: dict[str, list[str]] = {}
    for name, targets in refs.items():
        for t in targets:
            users.setdefault(t, []).append(name)
    ready = [name for name, n in waiting.items() if n == 0 and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].terminal = True
        for user in users.get(name, ()):
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                ready.append(user)
    # Lark names: root -> start, '-' -> '_', camelCase -> snake_case, terminals upper-case.
    names = {"root": "start"}
    taken = set(rules) - {"root"} | {"start"}
    for name, r in rules.items():
        if name == "root":
            continue
        new = re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_"))
        new = new.upper() if r.terminal else new.lower()
        if new != name:
            if new in taken:
                raise GbnfError(f"Rule '{new}' already exists")
            taken.discard(name)
            taken.add(new)
        names[name] = new
    out, prev_nl = ["%llguidance {}\n\n"], True
    for name, r in sorted(rules.items(), key=lambda item: item[1].order):
        s = f"{r.comment}{names[name]}: {_str(r.body, names, top=True)}"
        if not prev_nl and "\n" in s:
            out.append("\n")
        out.append(s + "\n")
        prev_nl = "\n" in s
        if prev_nl:
            out.append("\n")
    return "".join(out)


_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


def is_lark(text: str) -> bool:
    return _LARK.search(text) is not None
