"""llama.cpp's server API: POST /completion, POST /infill and GET /props, for the clients and
editor plugins written against llama-server.

A request is read in llama.cpp's field names and defaults (n_predict -1: until the window is
full; temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), turned into the OpenAI completion it
means and run by Serving.completions, so the parameter checks, limits, metrics and the path
into the engine are the OpenAI routes' own; the answer is reshaped into llama.cpp's (`content`,
`stop`, `stop_type`, `tokens_predicted`, ...; a stream is `data:` events, the last with
`"stop": true`, and no `[DONE]`). /infill builds the fill-in-the-middle prompt with the one
builder /v1/completions' `suffix` uses (tokenizer/fim.py), then continues it with `prompt`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from ... import __version__
from ...tokenizer.fim import fim_prompt, fim_tokens
from ..outputs import sse, sse_bodies
from ..protocol import APIError, CompletionRequest, check_fields
from ..protocol import Request as Body
from ..serving import ClientGone, Reply, Serving
from ..state import server_state
from ..wire import parse_body, respond
from .base import Route

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's


def _prompt(value: Any) -> Any:
    if isinstance(value, str) or (isinstance(value, list) and all(type(x) is int for x in value)):
        return value
    raise PydanticCustomError("wrong_type", "wrong type (expected a string or a list of token ids)")


class LlamaCompletion(Body):
    model: str | None = None
    prompt: Annotated[str | list[int], PlainValidator(_prompt)] = ""
    n_predict: int = -1
    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    logit_bias: list[list[int | float]] | dict[str, int | float] | None = None
    n_probs: int = 0
    cache_prompt: bool = True  # the prefix cache always serves what it holds
    id_slot: int = -1  # slots are the engine's business


class LlamaInfill(LlamaCompletion):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict] | None = None


def _completion(req: LlamaCompletion, prompt: str | list[int]) -> CompletionRequest:
    """The OpenAI completion a llama.cpp request means."""
    if req.n_predict == 0:
        raise APIError("n_predict=0 generates nothing", "n_predict")
    if req.n_probs:
        raise APIError("n_probs: token probabilities are not served on /completion; use /v1/completions' logprobs",
                       "n_probs", code="unsupported_parameter")
    bias = req.logit_bias
    if isinstance(bias, list):  # llama.cpp's [[token id, bias], ...]
        if not all(len(pair) == 2 and isinstance(pair[0], int) for pair in bias):
            raise APIError("logit_bias: pairs of [token id, bias]", "logit_bias")
        bias = {str(t): b for t, b in bias}
    return CompletionRequest.model_validate({
        "model": req.model, "prompt": prompt, "max_tokens": req.n_predict if req.n_predict > 0 else None,
        "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
        "repetition_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "seed": None if req.seed < 0 else req.seed,
        "stop": req.stop or None, "ignore_eos": req.ignore_eos, "logit_bias": bias, "stream": req.stream,
        "stream_options": {"include_usage": True} if req.stream else None})


def _final(choice: dict, usage: dict | None, model: str) -> dict:
    reason, finish = choice.get("stop_reason"), choice.get("finish_reason")
    return {"index": 0, "id_slot": 0, "stop": True, "model": model,
            "stop_type": "limit" if finish == "length" else "word" if isinstance(reason, str) else "eos",
            "stopping_word": reason if isinstance(reason, str) else "",
            "tokens_predicted": (usage or {}).get("completion_tokens", 0),
            "tokens_evaluated": (usage or {}).get("prompt_tokens", 0), "truncated": False}


async def _stream(events: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    """OpenAI's completion chunks as llama.cpp's: a `content` event per piece, then the last one."""
    last: dict | None = None
    async for body in sse_bodies(events):
        if "error" in body:
            yield sse(body)
            return
        for choice in body.get("choices") or []:
            if choice.get("text"):
                yield sse({"index": 0, "content": choice["text"], "stop": False, "id_slot": 0})
            if choice.get("finish_reason") is not None:
                last = choice
        if body.get("usage") and last is not None:
            yield sse({"content": "", **_final(last, body["usage"], model)})


async def _run(request: Request, body_model, make_prompt) -> Response:
    s = server_state(request)
    req = await parse_body(request, body_model, s.config.max_request_bytes)
    check_fields(req, request.url.path)
    creq = _completion(req, await make_prompt(s.serving, req))
    try:
        reply = await s.serving.completions(creq, request, until_full=True)
    except ClientGone:
        return Response(status_code=499)
    name = s.config.model_name
    if isinstance(reply.content, dict):
        choice = reply.content["choices"][0]
        content = {"content": choice["text"], **_final(choice, reply.content["usage"], name)}
        return respond(Reply(content, reply.headers), s.config.client_read_timeout)
    return respond(Reply(_stream(reply.content, name), reply.headers), s.config.client_read_timeout)


async def completion(request: Request) -> Response:
    async def prompt(serving: Serving, req: LlamaCompletion):
        if req.prompt == "" or req.prompt == []:
            raise APIError("prompt must not be empty", "prompt")
        return req.prompt

    return await _run(request, LlamaCompletion, prompt)


async def infill(request: Request) -> Response:
    async def prompt(serving: Serving, req: LlamaInfill) -> list[int]:
        if req.input_extra:
            raise APIError("input_extra: other files' context is not supported", "input_extra",
                           code="unsupported_parameter")
        if not isinstance(req.prompt, str):
            raise APIError("prompt: on /infill, text that starts the middle", "prompt")
        tokenizer = serving.tokenizer
        fim = fim_tokens(tokenizer)
        if fim is None:
            raise APIError("/infill: this model's vocabulary has no fill-in-the-middle tokens, so it cannot fill in",
                           "input_prefix", code="unsupported_value")
        serving.check_prompt_chars(len(req.input_prefix) + len(req.input_suffix) + len(req.prompt), "input_prefix")
        ids = await serving.encode(fim_prompt, tokenizer, fim, req.input_prefix, req.input_suffix)
        return ids + tokenizer.encode(req.prompt, add_special_tokens=False)

    return await _run(request, LlamaInfill, prompt)


async def props(request: Request) -> dict:
    s = server_state(request)
    engine = s.serving.engine.engine
    return {"default_generation_settings": {"n_ctx": s.serving.max_model_len, "model": s.config.model_name,
                                            "params": {**DEFAULTS, "n_predict": -1, "repeat_penalty": 1.0}},
            "total_slots": engine.config.max_num_seqs, "model_path": s.config.model_name,
            "chat_template": s.serving.tokenizer.chat_template or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"nanoinfer {__version__}"}


def _completion_text(req: dict) -> str:
    prompt = req.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _infill_text(req: dict) -> str:
    return f"{req.get('input_prefix', '')}\x00{req.get('input_suffix', '')}"


ROUTES = (
    Route("POST", "/completion", completion, prompt=_completion_text),
    Route("POST", "/infill", infill, prompt=_infill_text),
    Route("GET", "/props", props),
)
