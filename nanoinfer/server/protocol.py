"""The OpenAI-compatible request bodies, and the error body every failure is answered with.

Requests are pydantic models in strict mode: a number where a string belongs (or "1" where a
number belongs, or true where an integer belongs) is refused, not coerced. Every field is
honoured or refused: OpenAI's fields that change nothing by their nature (NO_EFFECT) are
accepted, the ones that would change the output but are not implemented here
(NOT_IMPLEMENTED) are a 400 naming them, and any other unknown field is ignored and logged once
per name. Ranges (temperature, top_p, ...) are checked once, by SamplingParams, and its error
names the field. `code` says what kind of error (`invalid_type`, `invalid_value`,
`missing_required_parameter`, `unsupported_parameter`, `context_length_exceeded`, ...). A body nested deeper than
MAX_JSON_DEPTH, or with a lone UTF-16 surrogate in a string, is refused by name. Parsing is
linear in the body's size whatever the body holds (a hostile one must not cost more than a
large honest one).
"""
from __future__ import annotations

import json
import logging
import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

MAX_JSON_DEPTH = 128  # nesting levels of a request body (serde_json's limit); deeper is a 400
logger = logging.getLogger("nanoinfer.server")


class APIError(Exception):
    """An error that becomes an HTTP response: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        if code is None and status == 400:  # a value the request got wrong, unless said more exactly
            code = "invalid_value"
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class Request(Strict):
    """A request body: its unknown fields are kept (model_extra) so that check_fields can sort them."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# OpenAI's request fields that change nothing here by their nature: accepted.
NO_EFFECT = {
    "user": "a caller's id, for abuse monitoring",
    "store": "whether OpenAI keeps the completion",
    "metadata": "tags for OpenAI's dashboard",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "a cache hint (the prefix cache finds shared prefixes by their tokens)",
    "safety_identifier": "a caller's id, for abuse monitoring",
    "parallel_tool_calls": "several calls in one reply are always parsed",
}
# OpenAI's fields that would change the output, not implemented: a 400 naming them.
NOT_IMPLEMENTED = {
    "audio": "audio output", "prediction": "predicted outputs", "web_search_options": "web search",
    "functions": "the deprecated functions (send tools)", "function_call": "the deprecated function_call (send tool_choice)",
    "reasoning_effort": "reasoning effort (no reasoning model is served)", "verbosity": "verbosity",
    "best_of": "best_of (generate n and return them all instead)",
}
_logged_unknown: set[str] = set()


def check_fields(req: Request, endpoint: str) -> None:
    """Refuse what would be a silent no-op; log once each field nobody here knows."""
    for name, value in (req.model_extra or {}).items():
        if name in NO_EFFECT or value is None:
            continue
        if name == "modalities" and value == ["text"]:
            continue
        if name == "best_of" and value == getattr(req, "n", 1):
            continue
        if name in NOT_IMPLEMENTED or name == "modalities":
            what = NOT_IMPLEMENTED.get(name, "output modalities other than text")
            raise APIError(f"{name}: {what} is not supported by this server", name, code="unsupported_parameter")
        if name not in _logged_unknown:
            _logged_unknown.add(name)
            logger.warning("%s: unknown request field %r ignored (logged once)", endpoint, name)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Request):
    """What completions and chat share; None means "the default" (OpenAI's SDK omits unset fields,
    other clients send null)."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # structured outputs, vLLM's request extras (server/constraints.py)
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, int | float] | None = None  # token id (as JSON keys are strings) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, with this many alternatives
    priority: int = 0  # vLLM's: lower is served first under --scheduling-policy priority (ignored under fcfs)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: as many as fit); overflow.py


def _prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], checked in Python: pydantic's union spent
    0.3 s on a megabyte of token ids holding the GIL (every stream of the server waited)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (all(type(x) is int for x in value) or all(type(x) is str for x in value)
                                    or all(type(x) is list and all(type(y) is int for y in x) for x in value)):
        return value
    raise PydanticCustomError("wrong_type", "wrong type (expected one of: str, list[str], list[int], list[list[int]])")


class CompletionRequest(SamplingFields):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], PlainValidator(_prompt)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    parse_special: bool = True  # special-token text in the prompt ("<|fim_prefix|>") becomes the token


class EmbeddingRequest(Request):
    input: Annotated[str | list[str] | list[int] | list[list[int]], PlainValidator(_prompt)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's, as for completions (overflow.py)


class ContentPart(Strict):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(Strict):
    name: str
    arguments: str | dict = "{}"


class MessageToolCall(Strict):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    # Extra keys (e.g. reasoning_content) go through to the chat template, as in transformers.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Strict):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None


class ToolDef(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class ResponseFormat(Strict):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM's: the template's opening of the assistant's turn
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    parse_special: bool = False  # special-token text in messages becomes the token (default: stays text)
    truncation: Literal["auto", "disabled"] | None = None  # "auto": drop the oldest turns to fit (overflow.py)


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # with `prompt`: BOS where the model adds one
    add_generation_prompt: bool = True  # with `messages`
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parse_special: bool | None = None  # default: as completions (prompt) or chat (messages) do


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]


# --- parsing ---------------------------------------------------------------------------

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


def _param(loc: tuple) -> tuple[str | None, list[str]]:
    """pydantic's error location as OpenAI's `param` ("messages[0].role"), and the union
    member names pydantic put into it (they say which types were expected)."""
    parts, tags = [], []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _FIELD.match(item) and item not in _TYPE_TAGS and not tags:
            parts.append(("." if parts else "") + item)
        else:  # a union member tag like 'list[int]' or 'ChatMessage': the path ends here
            tags.append(item)
            break
    return "".join(parts) or None, tags


_STRING_AT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # one JSON string, matched where it starts (linear)
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a surrogate gets into valid UTF-8 JSON


def _field_path(model: type[BaseModel], path: list) -> str | None:
    """The leading part of a JSON path that names request fields, as OpenAI's `param`:
    ["tools", 0, "function", "parameters", "a", ...] -> "tools[0].function.parameters" (below
    that is the caller's free-form JSON)."""
    parts: list[str] = []
    types: list = [model]
    for item in path:
        inner = []
        for t in types:
            if isinstance(item, int) and get_origin(t) is list:
                inner.append(get_args(t)[0])
            elif isinstance(item, str) and isinstance(t, type) and issubclass(t, BaseModel) and item in t.model_fields:
                inner.append(t.model_fields[item].annotation)
        types = [a for t in inner for a in (get_args(t) if get_origin(t) in (Union, UnionType) else (t,))]
        if not types:
            break
        parts.append(f"[{item}]" if isinstance(item, int) else ("." if parts else "") + item)
    return "".join(parts) or None


def _too_deep(model: type[BaseModel], path: list) -> APIError:
    param = _field_path(model, path)
    return APIError(f"{param or 'the request body'}: nested more than {MAX_JSON_DEPTH} levels deep", param,
                    code="invalid_value")


def _check_value(model: type[BaseModel], data: Any) -> None:
    """Refuse what parsed but nothing after it could use: nesting deeper than MAX_JSON_DEPTH, and
    a lone UTF-16 surrogate ("\\ud800": no UTF-8 encoding, so no tokenizer takes it). One
    iterative walk over the parsed value: linear in its size, whatever its shape (a path is a
    chain of (parent, key) links, spelled out only for the error)."""

    def spelled(link) -> list:
        keys = []
        while link is not None:
            link, key = link
            keys.append(key)
        return keys[::-1]

    stack: list[tuple[Any, Any, int]] = [(data, None, 0)]  # (value, its path link, its depth)
    while stack:
        value, link, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                param = _field_path(model, spelled(link))
                raise APIError(f"{param or 'the request body'}: a lone UTF-16 surrogate (\\ud800-\\udfff) "
                               "is not valid Unicode", param, code="invalid_value")
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep(model, spelled(link))
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and _SURROGATE.search(key):
                stack.append((key, link, depth))
            if isinstance(item, (str, dict, list)):
                stack.append((item, (link, key), depth + 1))


def _deep_path(text: str) -> list:
    """The path to the first container nested deeper than MAX_JSON_DEPTH, read from the text
    (for a body too deep for json.loads to parse): one linear scan, strings skipped whole."""
    path: list = []
    last_string = None
    pos, end = 0, len(text)
    while pos < end:
        c = text[pos]
        if c == '"':
            m = _STRING_AT.match(text, pos)
            if m is None:
                break  # an unterminated string: nothing further to read
            last_string = m.group()[1:-1]
            pos = m.end()
            continue
        if c in "[{":
            if len(path) >= MAX_JSON_DEPTH:
                break
            path.append(0 if c == "[" else None)
        elif c in "]}":
            if path:
                path.pop()
        elif c == ",":
            if path and isinstance(path[-1], int):
                path[-1] += 1
        elif c == ":" and path:
            path[-1] = last_string
        pos += 1
    return path


def parse_request(model: type[Strict], body: bytes) -> Any:
    """Body bytes -> a request model, or APIError(400) naming the first bad field. Linear in the
    body's size for any body (callers run large ones off the event loop)."""
    try:
        text = body.decode("utf-8")
        data = json.loads(text)
    except RecursionError:  # deeper than the interpreter's recursion limit: far past ours
        raise _too_deep(model, _deep_path(text)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(text):
        _check_value(model, data)  # else neither can be there: no walk
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        param, tags = _param(errors[0]["loc"])
        if tags:  # a union: say every shape that would have been accepted
            expected = []
            for err in errors:
                p, t = _param(err["loc"])
                if p == param and t and t[0] not in expected:
                    expected.append(t[0])
            raise APIError(f"{param}: wrong type (expected one of: {', '.join(expected)})", param,
                           code="invalid_type") from None
        what, code = errors[0]["msg"], "invalid_type"
        if errors[0]["type"] == "missing":
            what, code = "this field is required", "missing_required_parameter"
        elif errors[0]["type"] == "literal_error" and "ctx" in errors[0]:
            what, code = f"must be one of {errors[0]['ctx'].get('expected')}", "invalid_value"
        elif errors[0]["type"] == "wrong_type":
            code = "invalid_type"
        raise APIError(f"{param or 'body'}: {what}", param, code=code) from None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: text parts joined into one string, tool call
    arguments as objects (templates `tojson` them; OpenAI sends them as JSON strings), and a
    content always there: an assistant turn that made tool calls comes back from clients with
    `content: null` or none at all, and templates read message['content'] regardless."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(f"content part type {part.type!r} is not supported (only 'text')",
                                   f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            d["content"] = "".join(texts)
        if m.role == "developer":  # OpenAI's newer name for system; templates know only "system"
            d["role"] = "system"
        if m.tool_calls:
            calls = []
            for call in d["tool_calls"]:
                args = call["function"].get("arguments")
                if isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # not JSON: the template gets the string as it is
                calls.append(call)
            d["tool_calls"] = calls
        out.append(d)
    return out

