"""A request's structured-output constraint, from whichever field carries it: vLLM's request
extras (`structured_outputs`, and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`), OpenAI's `response_format`, or a `tool_choice` that demands a tool call.
At most one of them; a malformed one is a 400 naming its field."""
from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError
from ..sampling import StructuredOutputsParams
from ..tokenizer import TokenizerLike
from .protocol import APIError, ChatCompletionRequest, SamplingFields
from .tool_calls import CALL_CLOSE, CALL_OPEN

MAX_PARALLEL_CALLS = 8  # calls in one reply under tool_choice "required" (a small model may repeat calls forever)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _spec(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as e:
        raise APIError(f"{param}: {e}", param) from None
    except InvalidRequestError as e:
        raise APIError(str(e), _rename(e.param, param)) from None


def _rename(param: str | None, field: str) -> str:
    """StructuredOutputsParams' field path as this request names it."""
    if param and param.startswith("structured_outputs") and field != "structured_outputs":
        return field
    return param or field


def request_constraint(req: SamplingFields, tokenizer: TokenizerLike, tools: list[dict] | None = None
                       ) -> tuple[str, StructuredOutputsParams] | None:
    """(the request field that carries it, the constraint), or None."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise APIError("structured_outputs must be an object", "structured_outputs")
        found.append(("structured_outputs", _spec(dict(req.structured_outputs), "structured_outputs")))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec({kind: value}, name)))
    if isinstance(req, ChatCompletionRequest):
        if req.response_format is not None:
            spec = _response_format(req.response_format.type, req.response_format.model_extra or {})
            if spec is not None:
                found.append(("response_format", spec))
        if tools and req.tool_choice not in (None, "none", "auto"):
            found.append(("tool_choice", tool_call_constraint(tools, req.tool_choice, tokenizer)))
    if len(found) > 1:
        raise APIError(f"one constraint per request: got {', '.join(name for name, _ in found)}", found[1][0])
    return found[0] if found else None


def _response_format(kind: str, extra: dict) -> StructuredOutputsParams | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = extra.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("response_format json_schema needs a json_schema object", "response_format.json_schema")
        schema = js.get("schema")
        if schema is None:
            schema = {"type": "object"}  # OpenAI's schema is optional: any object then
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be an object", "response_format.json_schema.schema")
        return _spec({"json": schema}, "response_format.json_schema.schema")
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                   "response_format.type")


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_constraint(tools: list[dict], tool_choice: Any, tokenizer: TokenizerLike) -> StructuredOutputsParams:
    """Valid calls of the offered tools (tool_choice "required": one or more of any; a named
    function: one call of it) in the format the model's chat template teaches:
    `<tool_call>{...}</tool_call>` blocks where the template uses them (Hermes, Qwen), else a
    JSON object {"name", "arguments"} or a list of them, as vLLM does (also where the server
    wrote the tools in: the JSON form gets the budget rule that closes it before max_tokens).
    The server's tool-call parser reads either back."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen, one = [t for t in tools if t["function"]["name"] == name], True
    else:
        chosen, one = tools, False
    call = {"anyOf": [_call_schema(t) for t in chosen]} if len(chosen) > 1 else _call_schema(chosen[0])
    template = tokenizer.chat_template or ""
    marker = tokenizer.token_to_id(CALL_OPEN)
    hermes = CALL_OPEN in template and not (marker is not None and tokenizer.is_special(marker))
    if hermes:
        newline = json.dumps("\n")
        block = f"{json.dumps(CALL_OPEN + chr(10))} %json {json.dumps(call)} {json.dumps(chr(10) + CALL_CLOSE)}"
        lark = "start: call" + ("" if one else f" ({newline} call){{0,{MAX_PARALLEL_CALLS - 1}}}") + f"\ncall: {block}"
        return StructuredOutputsParams(grammar=lark)
    if one:
        return StructuredOutputsParams(json=call)
    return StructuredOutputsParams(json={"anyOf": [call, {"type": "array", "items": call, "minItems": 1,
                                                          "maxItems": MAX_PARALLEL_CALLS}]})
