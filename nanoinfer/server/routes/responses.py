"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, for clients
written against it (the `openai` SDK's `client.responses`, agents built on it).

A request is read in the Responses shape (`input` as text or items: messages, `function_call`
and `function_call_output`; `instructions`; flat function `tools`; `text.format`;
`max_output_tokens`; `truncation`), turned into the chat completion it means and run by
Serving.chat: the same template, tool-call parsing, structured outputs, checks, limits, metrics
and path into the engine as /v1/chat/completions. The answer is reshaped into a `response`
object (`output` items: a `message` with `output_text`, `function_call`s; `status` completed or
incomplete; `usage`), a stream into its typed events (response.created ... response.completed),
each with its `sequence_number`. Errors keep OpenAI's `{"error": {...}}` shape, named by this
request's fields.

Stored responses (`store`, default true) live in the server's ResponseStore (response_store.py: in
memory, least recently used forgotten): a later request's `previous_response_id` continues
one, its conversation being the stored one's input items and output followed by the new input
(`instructions` are not carried over, as OpenAI specifies). Behind `--replicas` a response id
names the replica that stored it (`resp_r{index}_...`), and the router sends requests that
refer to it there (Route.affinity).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..outputs import sse_bodies
from ..protocol import APIError, ChatCompletionRequest, check_fields
from ..protocol import Request as Body
from ..response_store import ResponseStore, StoredResponse
from ..serving import ClientGone, Reply
from ..state import server_state
from ..wire import parse_body, respond
from .base import Route

ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"  # the one `include` value that adds anything here
# Responses API fields that would change the output, not served here: a 400 naming them.
UNSUPPORTED = {"background": "background responses", "prompt": "stored prompt templates",
               "conversation": "conversation objects (send previous_response_id, or the whole input)"}


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict] | None = None
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    text: dict | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None  # with include ["message.output_text.logprobs"]
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None  # (echoed: no effect)
    user: str | None = None  # (echoed: no effect)
    parallel_tool_calls: bool | None = None  # (echoed: several calls in one reply are always parsed)
    max_tool_calls: int | None = None  # (counts built-in tool calls: none are served)
    reasoning: dict | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict | None = None  # (include_obfuscation: nothing is obfuscated here)


# --- the request: Responses items -> chat messages ----------------------------------------------
def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key}: a string is required", f"{where}.{key}",
                       code="missing_required_parameter" if value is None else "invalid_type")
    return value


def _text(content: Any, where: str) -> str:
    """A content of text parts (or a string) as one text; anything else is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: a string or a list of content parts", where, code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(f"{where}[{j}]: {kind} parts are not supported: the served model reads text only",
                           f"{where}[{j}].type", code="unsupported_value")
        else:
            raise APIError(f"{where}[{j}]: a content part of type {kind!r} is not supported here",
                           f"{where}[{j}].type", code="unsupported_value")
    return "".join(parts)


def _input_items(value: str | list[dict] | None) -> list[dict]:
    if value is None:
        return []
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


def _messages(instructions: str | None, items: list[dict], first: int) -> list[dict]:
    """The conversation's items as chat messages, after the instructions as the system message.
    Items before `first` come from a stored response (checked when it was made)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # one assistant turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thoughts: not part of this model's prompt
        else:
            raise APIError(f"{where}: input items of type {kind!r} are not supported (only messages, function_call "
                           "and function_call_output)", f"{where}.type", code="unsupported_value")
    return out


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The function tools and tool_choice as chat's; built-in tools are refused by name."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type")
            if kind != "function":
                raise APIError(f"tools[{i}]: the built-in tool {kind!r} is not supported (only function tools)",
                               f"tools[{i}].type", code="unsupported_value")
            fn = {"name": _string(t, "name", f"tools[{i}]"), "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")}
            tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return tools, choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":  # a subset of the tools, called as mode says
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        mode = choice.get("mode")
        if mode not in ("auto", "required"):
            raise APIError("tool_choice.mode must be auto or required", "tool_choice.mode")
        return [t for t in tools or [] if t["function"]["name"] in allowed] or None, mode
    raise APIError(f"tool_choice {choice!r}: auto, none, required, a function or allowed_tools (only function tools "
                   "are served)", "tool_choice.type" if kind else "tool_choice", code="unsupported_value")


def _response_format(text: dict | None) -> dict | None:
    """text.format (flat) as chat's response_format (json_schema nested), for the structured-output path."""
    if text is None:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise APIError("text.verbosity: only medium (the model's own) is supported", "text.verbosity",
                       code="unsupported_value")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise APIError(f"text.format.type {kind!r}: text, json_object or json_schema", "text.format.type")


def _check_fields(req: ResponsesRequest) -> None:
    """Refuse what this server cannot do by name (check_fields sorts the rest)."""
    for name, what in UNSUPPORTED.items():
        if (req.model_extra or {}).get(name) not in (None, False):
            raise APIError(f"{name}: {what} are not supported by this server", name, code="unsupported_parameter")
    effort = (req.reasoning or {}).get("effort")
    if effort not in (None, "none"):
        raise APIError(f"reasoning.effort {effort!r}: the served model does not reason (send none or leave it out)",
                       "reasoning.effort", code="unsupported_value")
    check_fields(req, "/v1/responses")


def _chat(req: ResponsesRequest, items: list[dict], first: int) -> ChatCompletionRequest:
    tools, choice = _tools(req)
    logprobs = LOGPROBS in (req.include or [])
    body = {"model": req.model, "messages": _messages(req.instructions, items, first),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": tools, "tool_choice": choice, "response_format": _response_format(req.text),
            "truncation": req.truncation, "logprobs": logprobs or None,
            "top_logprobs": req.top_logprobs if logprobs else None,
            "stream": req.stream, "stream_options": {"include_usage": True} if req.stream else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # (the fields above are checked; this is a last guard)
        raise APIError(f"the request does not make a valid conversation: {e.errors()[0]['msg']}") from None


# chat's names of the fields -> this request's (longest first)
_RENAMES = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"))


def _renamed(e: APIError) -> APIError:
    """An error of the chat request as this request's: its fields by their names here."""
    param, message = e.param, e.message
    if param and param.startswith("messages"):  # (chat's message indices are not input's)
        param = "input"
    elif param and param.startswith("tools["):
        param = param.replace(".function.", ".")
    for chat, ours in _RENAMES:
        if param and param.startswith(chat):
            param = ours + param[len(chat):]
        message = message.replace(chat, ours)
    return APIError(message.replace("messages", "input"), param, e.status, e.type, e.code)


def _previous(store: ResponseStore, rid: str | None) -> list[dict]:
    """The conversation a previous_response_id continues: its input items, then its output."""
    if rid is None:
        return []
    stored = store.get(rid)
    if stored is None:  # OpenAI's answer, also for a response made with store: false
        raise APIError(f"Previous response with id {rid!r} not found.", "previous_response_id",
                       code="previous_response_not_found")
    return stored.conversation


# --- the answer: a response object --------------------------------------------------------------
def _id(prefix: str, replica: int | None = None) -> str:
    return f"{prefix}_{'' if replica is None else f'r{replica}_'}{uuid.uuid4().hex}"


_REPLICA_ID = re.compile(r"resp_r(\d+)_[0-9a-f]{32}")


def _replica_of(path: str, req: dict) -> int | None:
    """The replica that stored the response a request refers to (Route.affinity): the one in its
    previous_response_id (POST) or in the path (GET, DELETE)."""
    rid = req.get("previous_response_id") if path == "/v1/responses" else path.rsplit("/", 1)[-1]
    m = _REPLICA_ID.fullmatch(rid) if isinstance(rid, str) else None
    return int(m.group(1)) if m else None


def _status(finish: str | None) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "abort":  # the server shut down mid-reply
        return "incomplete", None
    return "completed", None


def _text_part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict]) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _output(choice: dict) -> list[dict]:
    """A chat choice as output items: the message (if it wrote text, or nothing at all), then its calls."""
    message, calls = choice["message"], choice["message"].get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        items.append(_message_item(_id("msg"), message.get("content") or "", _status(choice["finish_reason"])[0],
                                   logprobs))
    return items + [_call_item(_id("fc"), call) for call in calls]


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _response(req: ResponsesRequest, rid: str, created: int, model: str, output: list[dict], usage: dict | None,
              finish: str | None, done: bool = True) -> dict:
    """The response object: the request's settings echoed, and what came of it (`done`: else in progress)."""
    status, details = _status(finish) if done else ("in_progress", None)
    now = int(time.time())
    return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "completed_at": now if status == "completed" else None, "error": None, "incomplete_details": details,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": _usage(usage) if usage else None, "user": req.user, "metadata": req.metadata or {}}


# --- the stream: chat chunks -> Responses events --------------------------------------------------
class _Events:
    """A response's event stream as it is written: sequence numbers, the output items so far, the
    message item being written (text arrives into it delta by delta)."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict] = []
        self.message: dict | None = None  # the open message item
        self.index = -1  # its output_index

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def open_message(self) -> list[str]:
        self.message, self.index = _message_item(_id("msg"), "", "in_progress", []), len(self.output)
        self.output.append(self.message)
        where = {"item_id": self.message["id"], "output_index": self.index}
        return [self.event("response.output_item.added", output_index=self.index, item={**self.message, "content": []}),
                self.event("response.content_part.added", **where, content_index=0, part=_text_part("", []))]

    def text(self, delta: str, logprobs: list[dict]) -> list[str]:
        events = self.open_message() if self.message is None else []
        part = self.message["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        return events + [self.event("response.output_text.delta", item_id=self.message["id"], output_index=self.index,
                                    content_index=0, delta=delta, logprobs=logprobs)]

    def close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        message, where = self.message, {"item_id": self.message["id"], "output_index": self.index}
        message["status"], part = status, message["content"][0]
        self.message = None
        return [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=message)]

    def call(self, call: dict) -> list[str]:
        """A whole call (the chat stream sends each one complete): added, its arguments, done."""
        events = self.close_message("completed")
        item, index = _call_item(_id("fc"), call), len(self.output)
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return events + [
            self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                               "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item)]


async def _stream(chunks: AsyncIterator[str], start: dict,
                  complete: Callable[[list[dict], str | None, dict], dict]) -> AsyncIterator[str]:
    """A chat chunk stream as the Responses event sequence; `complete` makes (and stores) the final response."""
    ev, finish = _Events(), None
    yield ev.event("response.created", response=start)
    yield ev.event("response.in_progress", response=start)
    async with aclosing(chunks):  # (closing it aborts the engine request)
        async for body in sse_bodies(chunks):
            if "error" in body:  # failed midway: the stream ends with the error
                e = body["error"]
                yield ev.event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
                return
            for choice in body.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for s in ev.text(delta["content"], (choice.get("logprobs") or {}).get("content") or []):
                        yield s
                for call in delta.get("tool_calls") or []:
                    for s in ev.call(call):
                        yield s
                finish = choice.get("finish_reason") or finish
            if body.get("usage") and finish is not None:  # the last chunk
                status = _status(finish)[0]
                events = ev.open_message() if not ev.output else []  # nothing written: an empty message, as unstreamed
                for s in events + ev.close_message(status):
                    yield s
                response = complete(ev.output, finish, body["usage"])
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield ev.event(kind, response=response)


# --- the endpoints --------------------------------------------------------------------------------
async def create(request: Request) -> Response:
    s = server_state(request)
    req = await parse_body(request, ResponsesRequest, s.config.max_request_bytes)
    _check_fields(req)
    history = _previous(s.responses, req.previous_response_id)
    items = history + _input_items(req.input)
    try:
        reply = await s.serving.chat(_chat(req, items, len(history)), request)
    except APIError as e:
        raise _renamed(e) from None
    except ClientGone:
        return Response(status_code=499)
    rid, created, model = _id("resp", s.config.replica_index), int(time.time()), s.config.model_name

    def complete(output: list[dict], finish: str | None, usage: dict) -> dict:
        response = _response(req, rid, created, model, output, usage, finish)
        if req.store:
            conversation = items + output
            size = len(json.dumps(response)) + len(json.dumps(conversation))
            s.responses.put(rid, StoredResponse(response, conversation, size))
        return response

    if isinstance(reply.content, dict):
        choice = reply.content["choices"][0]
        body = complete(_output(choice), choice["finish_reason"], reply.content["usage"])
        return respond(Reply(body, reply.headers), s.config.client_read_timeout)
    start = _response(req, rid, created, model, [], None, None, done=False)
    return respond(Reply(_stream(reply.content, start, complete), reply.headers), s.config.client_read_timeout)


def _not_found(rid: str) -> APIError:
    return APIError(f"Response with id {rid!r} not found.", "response_id", status=404, code="response_not_found")


async def retrieve(response_id: str, request: Request) -> dict:
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


async def delete(response_id: str, request: Request) -> dict:
    if not server_state(request).responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _prompt_text(req: dict) -> str:
    instructions, given = req.get("instructions"), req.get("input")
    return (instructions if isinstance(instructions, str) else "") + (given if isinstance(given, str)
                                                                       else json.dumps(given))


ROUTES = (
    Route("POST", "/v1/responses", create, prompt=_prompt_text, affinity=_replica_of),
    Route("GET", "/v1/responses/{response_id}", retrieve, affinity=_replica_of),
    Route("DELETE", "/v1/responses/{response_id}", delete, affinity=_replica_of),
)
