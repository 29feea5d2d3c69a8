"""Closing a JSON value before the token budget runs out.

A small model under a schema sometimes loops inside a value the schema does not bound (a
string that repeats a phrase, a tree that nests without end, a number with a hundred digits).
Cut off by `max_tokens`, that output is not JSON at all. So a JSON-constrained row that nears
its budget (`LOOKAHEAD` tokens left) plans, each step, the shortest way it knows to a complete
value from where it is; when that plan would no longer fit with `MARGIN` tokens to spare, the
row follows it token by token (its mask allows only the plan's next token) and ends with a
valid, complete value: `finish_reason` "stop". A plan that does not fit at all is never
started: the row runs on and ends with "length", as without this.

The plan: close the open string, then the open arrays and objects (the longest token that
spells a prefix of that closing text, e.g. `"}]}`); where the schema does not allow closing
yet (a required key, `minItems`), the shortest JSON that moves on (`,` `:` `1` `0` `"` `[` `{`
`null` ...); where none of those fits, what the grammar forces (a required key's name), else
the allowed token that spells the most text (an enum, a pattern). Every token is checked by the grammar, so the plan is valid by
construction; its length is what is checked against the budget."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import Matcher, allowed_tokens

LOOKAHEAD = 128  # rows this close to their budget check whether they must start closing
MARGIN = 16  # room kept for what one more free token can add to the plan (rows near the end look every step)

_STEP_ON = [b",", b":", b"1", b"0", b'"', b"[", b"{", b"null", b"false", b"true"]
_CLOSERS = frozenset(b'"]}')


@dataclass
class JsonScan:
    """Where a prefix of JSON text stands: inside a string or not, and the open brackets."""

    in_string: bool = False
    escape: bool = False
    stack: bytes = b""

    def feed(self, data: bytes) -> None:
        for c in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == 0x5C:  # backslash
                    self.escape = True
                elif c == 0x22:
                    self.in_string = False
            elif c == 0x22:
                self.in_string = True
            elif c in (0x5B, 0x7B):  # [ {
                self.stack += b"]" if c == 0x5B else b"}"
            elif c in (0x5D, 0x7D) and self.stack:
                self.stack = self.stack[:-1]

    def closing(self) -> bytes:
        """The text that would close everything open (if the schema allowed it now)."""
        return (b'"' if self.in_string and not self.escape else b"") + self.stack[::-1]

    def copy(self) -> JsonScan:
        return JsonScan(self.in_string, self.escape, self.stack)


class JsonCloser:
    """One vocabulary's closing plans (built once per engine: a pass over the vocabulary)."""

    def __init__(self, token_bytes: list[bytes], special: set[int], eos_ids: list[int]):
        self.token_bytes = token_bytes
        self.eos_ids = eos_ids
        self.closers: dict[bytes, int] = {}
        wanted = set(_STEP_ON)
        step_on: dict[bytes, int] = {}
        for i, b in enumerate(token_bytes):
            if i in special or not b:
                continue
            if set(b) <= _CLOSERS:
                self.closers.setdefault(b, i)
            if b in wanted:
                step_on.setdefault(b, i)
        self.step_on = [step_on[b] for b in _STEP_ON if b in step_on]
        self.max_closer = max(map(len, self.closers), default=0)
        self.lengths = np.array([0 if i in special else len(b) for i, b in enumerate(token_bytes)], dtype=np.int64)

    def next_token(self, m: Matcher, scan: JsonScan) -> int | None:
        if m.is_accepting():
            return next((e for e in self.eos_ids if m.allows(e)), None)
        closing = scan.closing()
        for n in range(min(len(closing), self.max_closer), 0, -1):
            t = self.closers.get(closing[:n])
            if t is not None and m.allows(t):
                return t
        if not scan.in_string:
            for t in self.step_on:
                if m.allows(t):
                    return t
        forced = m.forced_tokens()
        if forced:
            return forced[0]
        words = np.zeros((len(self.lengths) + 31) // 32, dtype=np.uint32)
        m.fill_mask(words)
        allowed = allowed_tokens(words, len(self.lengths))
        scores = np.where(allowed, self.lengths, -1)
        best = int(scores.argmax())
        return best if scores[best] > 0 else None

    def plan(self, m: Matcher, scan: JsonScan, budget: int) -> list[int] | None:
        """The tokens that complete the value from here (on copies), or None if it takes more
        than `budget` tokens or the plan finds no way on."""
        m, scan = m.copy(), scan.copy()
        out: list[int] = []
        while not m.is_terminated():
            if len(out) == budget:
                return None
            t = self.next_token(m, scan)
            if t is None:
                return None
            out.append(t)
            if t in self.eos_ids:
                break
            if not m.accept(t):
                return None
            scan.feed(self.token_bytes[t])
        return out
