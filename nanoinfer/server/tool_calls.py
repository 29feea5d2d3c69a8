"""Tool calls out of generated text, for chat requests that carry `tools`.

Models write tool calls as text in one of a few conventions; the chat template told them which.
The ones understood here:

* Hermes / Qwen 2.5+ / many fine-tunes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  possibly several, possibly after some text;
* Llama 3.x (and Mistral after its `[TOOL_CALLS]` token): the whole reply is a JSON object
  `{"name": ..., "parameters": {...}}` (or "arguments"), or a list of them, possibly after
  `<|python_tag|>`. Marker tokens that are special are already gone from the text.

One streaming parser serves both paths: `feed` text as it comes and get back content to show
and finished calls; `finish` at the end. The non-streaming path feeds everything at once, so
both paths agree on every output.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..tokenizer.tool_prompt import CALL_CLOSE, CALL_OPEN

PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def as_tool_call(obj) -> ToolCall | None:
    """A parsed JSON value that looks like one call: {"name": str, "arguments"|"parameters": ...}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if not isinstance(args, (dict, str)):
        return None
    # Some models write the arguments as a JSON string already; pass it through unchanged.
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_DECODER = json.JSONDecoder()


def _json_calls(text: str) -> list[ToolCall] | None:
    """`text` as a whole is one or more JSON tool calls (objects or lists of them, separated by
    whitespace, ',' or ';'); None if it is not, or not yet complete."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        parsed = [as_tool_call(o) for o in items]
        if not parsed or any(c is None for c in parsed):
            return None
        calls.extend(parsed)


class ToolCallParser:
    """Splits streamed text into content and tool calls. Events: ("content", str) and ("call", ToolCall)."""

    def __init__(self) -> None:
        self.mode = "start"  # start -> text | json;  text <-> call
        self.buffer = ""
        self.pending_space = ""  # whitespace before any text or after a call: shown only if text follows
        self.shown = False  # some content was emitted
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        events: list[tuple[str, object]] = []
        while True:
            before = (self.mode, len(self.buffer))
            getattr(self, f"_step_{self.mode}")(events, final=False)
            if (self.mode, len(self.buffer)) == before:
                return events

    def finish(self) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        while self.buffer:
            before = (self.mode, len(self.buffer))
            getattr(self, f"_step_{self.mode}")(events, final=True)
            if (self.mode, len(self.buffer)) == before:
                break
        if self.pending_space and not self.calls:  # the reply was only whitespace
            events.append(("content", self.pending_space))
            self.pending_space = ""
        return events

    # --- states ---------------------------------------------------------------------
    def _step_start(self, events: list, final: bool) -> None:
        # The first visible characters decide: JSON (Llama style) or text (maybe with <tool_call>).
        head = self.buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            self.buffer = head[len(PYTHON_TAG):]
            self.mode = "json"
        elif head[:1] in ("{", "["):
            self.mode = "json"
        elif head and not final and (PYTHON_TAG.startswith(head) or CALL_OPEN.startswith(head)):
            return  # could still become a marker: wait
        elif head or final:
            self.mode = "text"

    def _step_json(self, events: list, final: bool) -> None:
        calls = _json_calls(self.buffer)
        if calls is not None:
            self.buffer = ""
            self._emit_calls(events, calls)
        elif final:
            self._content(events, self.buffer)  # not a tool call after all: it was the answer
            self.buffer = ""

    def _step_text(self, events: list, final: bool) -> None:
        at = self.buffer.find(CALL_OPEN)
        if at >= 0:
            self._content(events, self.buffer[:at])
            self.buffer = self.buffer[at + len(CALL_OPEN):]
            self.mode = "call"
            return
        keep = 0 if final else _partial_suffix(self.buffer, CALL_OPEN)
        cut = len(self.buffer) - keep
        self._content(events, self.buffer[:cut])
        self.buffer = self.buffer[cut:]

    def _step_call(self, events: list, final: bool) -> None:
        at = self.buffer.find(CALL_CLOSE)
        if at < 0 and not final:
            return
        body = self.buffer if at < 0 else self.buffer[:at]  # final: an unclosed call (EOS came first)
        rest = "" if at < 0 else self.buffer[at + len(CALL_CLOSE):]
        calls = _json_calls(body.strip())
        if calls:
            self._emit_calls(events, calls)
        else:  # unreadable: show it as it was written rather than lose it
            self._content(events, CALL_OPEN + body + ("" if at < 0 else CALL_CLOSE))
        self.buffer, self.mode = rest, "text"

    # --- output ---------------------------------------------------------------------
    def _emit_calls(self, events: list, calls: list[ToolCall]) -> None:
        self.pending_space = ""
        for call in calls:
            self.calls.append(call)
            events.append(("call", call))

    def _content(self, events: list, text: str) -> None:
        if not text:
            return
        text, self.pending_space = self.pending_space + text, ""
        # Whitespace before a call or between calls is layout, not content.
        if (self.calls or not self.shown) and not text.strip():
            self.pending_space = text
            return
        self.shown = True
        events.append(("content", text))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output at once: (content, calls). Content is None when only calls were written."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    calls = [e for kind, e in events if kind == "call"]
    if not calls:
        return text, []
    content = "".join(e for kind, e in events if kind == "content").strip()
    return content or None, calls
