"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for Claude-style
clients (the `anthropic` SDK, agents built on it) pointed at a local model.

A request is read in Anthropic's shape (`system`, content blocks, `tool_use` / `tool_result`,
`tool_choice`, `stop_sequences`, `max_tokens` required), turned into the chat completion it
means and run by Serving.chat: the same template, tool-call parsing, checks, limits, metrics and
path into the engine as /v1/chat/completions. The answer is reshaped into Anthropic's message
(`content` blocks, `stop_reason`: end_turn / max_tokens / stop_sequence / tool_use, `usage`), a
stream into its typed events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop), and errors into `{"type": "error", "error": {type, message}}`.
`x-api-key` is accepted beside `Authorization` when the server has --api-key (access.py).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..outputs import sse_bodies
from ..protocol import APIError, ChatCompletionRequest, check_fields, message_dicts
from ..protocol import Request as Body
from ..serving import ClientGone, Reply
from ..state import server_state
from ..wire import parse_body, respond
from .base import Route

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(Body):
    model: str | None = None
    max_tokens: int
    messages: list[dict]
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None  # (a caller's id: no effect)
    thinking: dict | None = None


class CountTokensRequest(Body):
    model: str | None = None
    messages: list[dict]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


def _text(blocks: Any, where: str) -> str:
    """A content of text blocks (or a string) as one text; anything else is refused by name."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(f"{where}: a string or a list of content blocks", where)
    parts = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        elif kind in ("image", "document"):
            raise APIError(f"{where}[{i}]: {kind} blocks are not supported: the served model reads text only",
                           f"{where}[{i}].type", code="unsupported_value")
        else:
            raise APIError(f"{where}[{i}]: a content block of type {kind!r} is not supported here", f"{where}[{i}]")
    return "".join(parts)


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """Anthropic's system and messages as OpenAI chat messages."""
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        role, content, where = m.get("role"), m.get("content"), f"messages[{i}].content"
        if role not in ("user", "assistant"):
            raise APIError(f"messages[{i}].role must be user or assistant", f"messages[{i}].role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(f"{where}: a string or a list of content blocks", where)
        text, calls = [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_result" and role == "user":
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _text(result, f"{where}[{j}].content")})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": str(b.get("name", "")), "arguments": json.dumps(b.get("input", {}))}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # a reasoning model's earlier thoughts: not part of this model's prompt
            else:
                text.append(_text([b], where))
        if text or calls or role == "assistant":
            message: dict = {"role": role, "content": "".join(text) if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, Any]:
    """Anthropic's tools and tool_choice as OpenAI's; its server tools are refused by name."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type", "custom")
            if kind != "custom":
                raise APIError(f"tools[{i}]: the server tool {kind!r} is not supported (only custom tools)",
                               f"tools[{i}].type", code="unsupported_value")
            tools.append({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}})
    choice = req.tool_choice
    if choice is None:
        return tools, None
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise APIError(f"tool_choice.type {kind!r}: auto, any, tool or none", "tool_choice.type")
    return tools, mapped


def _chat(req: MessagesRequest) -> ChatCompletionRequest:
    if req.thinking and req.thinking.get("type") not in (None, "disabled"):
        raise APIError("thinking: extended thinking is not supported by the served model", "thinking",
                       code="unsupported_parameter")
    tools, choice = _tools(req)
    body = {"model": req.model, "messages": _messages(req), "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
            "tools": tools, "tool_choice": choice, "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def _stop_reason(finish: str | None, stop: Any, tool_calls: bool) -> tuple[str, str | None]:
    if tool_calls or finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _message(body: dict, model: str) -> dict:
    choice = body["choices"][0]
    msg = choice["message"]
    content: list[dict] = [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    reason, sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(msg.get("tool_calls")))
    usage = body["usage"]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _stream(chunks: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    """OpenAI's chat chunks as Anthropic's event sequence."""
    yield _event("message_start", {"message": {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    index, open_text, finish = -1, False, None
    async for body in sse_bodies(chunks):
        if "error" in body:
            error = body["error"]
            yield _event("error", {"error": {"type": ERROR_TYPES.get(400, "api_error"), "message": error.get("message")}})
            return
        for choice in body.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if not open_text:
                    index, open_text = index + 1, True
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                               "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                if open_text:
                    yield _event("content_block_stop", {"index": index})
                    open_text = False
                index += 1
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"] or "{}"}})
                yield _event("content_block_stop", {"index": index})
            if choice.get("finish_reason") is not None:
                finish = choice
        usage = body.get("usage")
        if usage and finish is not None:
            if open_text:
                yield _event("content_block_stop", {"index": index})
            reason, sequence = _stop_reason(finish["finish_reason"], finish.get("stop_reason"), False)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"input_tokens": usage["prompt_tokens"],
                                                     "output_tokens": usage["completion_tokens"]}})
            yield _event("message_stop", {})


def _error(e: APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status)


async def messages(request: Request) -> Response:
    s = server_state(request)
    try:
        req = await parse_body(request, MessagesRequest, s.config.max_request_bytes)
        check_fields(req, "/v1/messages")
        reply = await s.serving.chat(_chat(req), request)
    except APIError as e:
        return _error(e)
    except ClientGone:
        return Response(status_code=499)
    name = s.config.model_name
    if isinstance(reply.content, dict):
        return respond(Reply(_message(reply.content, name), reply.headers), s.config.client_read_timeout)
    return respond(Reply(_stream(reply.content, name), reply.headers), s.config.client_read_timeout)


async def count_tokens(request: Request) -> Response:
    s = server_state(request)
    try:
        req = await parse_body(request, CountTokensRequest, s.config.max_request_bytes)
        s.serving.check_model(req.model)
        tools, choice = _tools(req)
        chat = ChatCompletionRequest.model_validate({"messages": _messages(req)})
        ids = await s.serving.chat_ids(chat, message_dicts(chat.messages), None if choice == "none" else tools)
    except APIError as e:
        return _error(e)
    return JSONResponse({"input_tokens": len(ids)})


def _prompt_text(req: dict) -> str:
    system = req.get("system")
    return (system if isinstance(system, str) else json.dumps(system)) + json.dumps(req.get("messages"))


ROUTES = (
    Route("POST", "/v1/messages", messages, prompt=_prompt_text),
    Route("POST", "/v1/messages/count_tokens", count_tokens),
)
