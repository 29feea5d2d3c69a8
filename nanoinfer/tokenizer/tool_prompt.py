"""Tools for chat templates that do not render them.

A chat template that knows tools lists them in the prompt and teaches the model its call
format (Qwen, Hermes, Llama 3.1, Mistral, SmolLM3, ...). Many do not (SmolLM2's, Gemma's,
Phi-3's, OLMo 2's): given `tools` they render exactly what they render without, so a model
served behind them never hears of the tools. For those, as llama.cpp does, the prompt gets a
section of its own: the tools' JSON schemas in the system message, and the call format the
server's tool-call parser reads back (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).

The conversation's tool turns are written in the same format, because such templates drop what
they do not know: an assistant turn's `tool_calls` become `<tool_call>` blocks after its text,
and `tool` results become a user turn of `<tool_response>` blocks (one turn for consecutive
results: templates that insist on alternating user and assistant accept it).
"""
from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

SECTION = """# Tools

You can call functions to help with the user's request. Each function is described by a JSON schema:
<tools>
{tools}
</tools>

To call functions, reply with one block per call, each holding a JSON object with the function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>
The results come back in <tool_response></tool_response> blocks."""


def tool_section(tools: list[dict]) -> str:
    return SECTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_block(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):  # OpenAI's form is a JSON string: keep what it says
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "" if content is None else json.dumps(content, ensure_ascii=False)


def flatten_tool_turns(messages: list[dict]) -> list[dict]:
    """Tool calls and tool results as text in ordinary turns (see the module docstring)."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = [call_block(c.get("function", {}).get("name", ""), c.get("function", {}).get("arguments", {}))
                      for c in m["tool_calls"]]
            text = _text(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join([text] + blocks if text else blocks)
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{_text(m.get('content'))}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_tool_results": True}
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out


def with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation with its tool turns as text and, given tools, their section at the end of
    the system message (a system message of its own when there is none)."""
    messages = flatten_tool_turns(messages)
    if not tools:
        return messages
    section = tool_section(tools)
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        text = _text(first.get("content"))
        first["content"] = f"{text}\n\n{section}" if text else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
