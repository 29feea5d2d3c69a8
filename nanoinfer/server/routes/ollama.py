"""Ollama's API: POST /api/chat and /api/generate (both generate), /api/embed and the older
/api/embeddings (Serving.embed: /v1/embeddings' vectors), GET /api/tags, POST /api/show,
GET /api/ps and GET /api/version, for the clients written against Ollama (the `ollama` SDK, Open
WebUI, editor plugins) pointed at nanoinfer.

A request is read in Ollama's shape (`options` for the sampling parameters, `format` for JSON
output, `stream` true unless said otherwise), turned into the chat completion or completion it
means and run by Serving.chat / Serving.completions: the same template, tool-call parsing,
structured outputs, checks, limits, metrics and path into the engine as the OpenAI routes. The
answer is reshaped into Ollama's: a stream is NDJSON (one JSON object a line, the last with
`done: true`, `done_reason` and the counts and durations in nanoseconds); errors are
`{"error": "..."}` with the HTTP status, and a stream that fails midway ends with such a line.

Serving is always asked for a stream, and a `stream: false` reply is that stream folded into one
object, as Ollama itself answers: only the stream shows when the first token came, which splits
prompt_eval_duration from eval_duration.

What is honoured, ignored or refused:
- model: the served name, also with Ollama's `:latest` tag; /api/tags lists it with the tag.
- options: temperature, top_p, top_k, min_p, seed (negative: random), num_predict (negative or
  absent: until the window is full; 0 is refused), stop, repeat_penalty, presence_penalty,
  frequency_penalty; where absent, Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9).
  Ignored (they do not change the output here): the load-time options (num_ctx, num_batch,
  num_gpu, main_gpu, num_thread, numa, low_vram, f16_kv, use_mmap, use_mlock, vocab_only,
  logits_all, embedding_only), num_keep, repeat_last_n (the penalties cover the prompt and the
  whole output, as vLLM's do) and penalize_newline (Ollama ignores it too). num_ctx is ignored at
  any value: the window is the server's (--max-model-len), and a prompt that does not fit is
  refused as on the OpenAI routes. typical_p, tfs_z and mirostat are refused unless they are
  their no-op values (1, 1, 0). Unknown options are logged once.
- keep_alive: ignored (the model stays loaded). An empty /api/chat `messages` or /api/generate
  `prompt` answers `done_reason: "load"` at once, as Ollama does.
- Refused with a 400: images (the served model reads text only), think (no reasoning model is
  served), logprobs, /api/generate's `template` (Ollama's Go templates; the model's own chat
  template is used) and `context` (token ids of an earlier exchange: send the conversation to
  /api/chat), and `system` beside `raw` or `suffix` (those prompts have no system part).
- /api/generate: `raw` sends the prompt as it is; else the prompt (with `system`) is a chat's
  user turn under the chat template, as Ollama does. `suffix` fills in the middle through
  /v1/completions' own suffix (tokenizer/fim.py). Replies carry no `context`.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache, wraps
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ... import __version__
from ...engine import LLMEngine
from ...kernels.quant_linear import QuantEmbedding, QuantLinear, parameter_count
from ...tokenizer.fim import fim_tokens
from ..outputs import sse_bodies
from ..protocol import APIError, ChatCompletionRequest, CompletionRequest, MessageToolCall, Strict, ToolDef, check_fields
from ..protocol import Request as Body
from ..serving import ClientGone, Reply, unless_gone
from ..state import ServerState, server_state
from ..wire import parse_body, respond
from .base import Route
from .openai import chat_prompt

NDJSON = "application/x-ndjson"
TAG = ":latest"  # Ollama's default tag: "name" and "name:latest" are one model
# What SamplingParams' messages call an option Ollama names otherwise
_OLLAMA_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
# Options that change the output, accepted at their no-op value only
_NO_OP = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
# Ollama's sampling defaults, where a request leaves them out (its repeat_penalty 1.1 is not taken:
# it covers only the last repeat_last_n tokens there, and Ollama's newer engine applies none)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


class Options(Body):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: Any = None  # (only with mirostat)
    mirostat_eta: Any = None
    # accepted, no effect on the output here (see the module docstring)
    num_ctx: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    num_thread: Any = None
    numa: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    vocab_only: Any = None
    logits_all: Any = None
    embedding_only: Any = None
    num_keep: Any = None
    repeat_last_n: Any = None
    penalize_newline: Any = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[MessageToolCall] | None = None  # Ollama's {"function": {"name", "arguments": {...}}}
    tool_name: str | None = None  # a tool turn's: the tool that answered
    thinking: str | None = None  # a reasoning model's earlier thoughts: not part of this model's prompt


class _Generating(Body):
    model: str
    stream: bool = True  # Ollama's default
    format: str | dict | None = None
    options: Options | None = None
    keep_alive: Any = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Generating):
    messages: list[Message] = []
    tools: list[ToolDef] | None = None


class GenerateBody(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None


class EmbedBody(Body):
    model: str
    input: str | list[str]
    truncate: bool = True  # Ollama's: an input past the window is cut to its first tokens (else a 400)
    dimensions: int | None = None
    options: Options | None = None  # (nothing in them changes an embedding)
    keep_alive: Any = None


class LegacyEmbedBody(Body):
    model: str
    prompt: str
    options: Options | None = None
    keep_alive: Any = None


class ShowBody(Body):
    model: str | None = None
    name: str | None = None  # older clients' name for it
    verbose: bool = False


# --- requests in ----------------------------------------------------------------------------
def _model(s: ServerState, name: str) -> str:
    """The served model's name for `name` ("name" or "name:latest"), or Ollama's 404."""
    served = s.config.model_name
    if name in (served, served + TAG):
        return served
    raise APIError(f"model '{name}' not found", "model", status=404, code="model_not_found")


def _refuse_unsupported(req: _Generating, endpoint: str) -> None:
    check_fields(req, endpoint)
    if req.think not in (None, False):
        raise APIError("think: thinking is not supported by the served model", "think", code="unsupported_parameter")
    if req.logprobs:
        raise APIError(f"logprobs are not served on {endpoint}; use /v1/chat/completions or /v1/completions",
                       "logprobs", code="unsupported_parameter")


def _sampling(options: Options | None, endpoint: str) -> dict:
    """Ollama's options (and its defaults) as the OpenAI request's sampling fields."""
    if options is None:
        return dict(DEFAULTS)
    check_fields(options, f"{endpoint} options")  # unknown options: logged once
    for name, no_op in _NO_OP.items():
        value = getattr(options, name)
        if value is not None and value != no_op:
            raise APIError(f"options.{name}: not supported by this server (only {no_op}, which changes nothing)",
                           f"options.{name}", code="unsupported_parameter")
    n = options.num_predict
    if n == 0:
        raise APIError("options.num_predict=0 generates nothing", "options.num_predict")
    fields = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
              "min_p": options.min_p, "seed": None if options.seed is None or options.seed < 0 else options.seed,
              "max_tokens": n if n is not None and n > 0 else None, "stop": options.stop or None,
              "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
              "frequency_penalty": options.frequency_penalty}
    return {**DEFAULTS, **{k: v for k, v in fields.items() if v is not None}}


def _format(value: str | dict | None, chat: bool) -> dict:
    """Ollama's `format` ("json": any JSON object; an object: a JSON schema) as the field that
    carries it on the request it becomes: a chat's response_format, a completion's structured_outputs."""
    if value in (None, ""):
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}} if chat else {"structured_outputs": {"json_object": True}}
    if isinstance(value, dict):
        return ({"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
                if chat else {"structured_outputs": {"json": value}})
    raise APIError(f"format: \"json\" or a JSON schema object, not {value!r}", "format")


def _messages(messages: list[Message]) -> list[dict]:
    """Ollama's messages as OpenAI chat messages."""
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(f"messages[{i}].images: images are not supported: the served model reads text only",
                           f"messages[{i}].images", code="unsupported_value")
        message: dict = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_name is not None:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _stream_fields() -> dict:
    return {"stream": True, "stream_options": {"include_usage": True}}


def _chat_request(req: ChatBody, model: str) -> ChatCompletionRequest:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ChatCompletionRequest.model_validate({
        "model": model, "messages": _messages(req.messages), **({"tools": tools} if tools else {}),
        **_format(req.format, chat=True), **_sampling(req.options, "/api/chat"), **_stream_fields()})


def _generate_request(req: GenerateBody, model: str) -> ChatCompletionRequest | CompletionRequest:
    """raw or suffix: a completion of the prompt as it is (suffix: filled in the middle); else a
    chat whose user turn is the prompt, under the chat template."""
    if req.images:
        raise APIError("images are not supported: the served model reads text only", "images",
                       code="unsupported_value")
    if req.template:
        raise APIError("template: Ollama's templates are not supported; the model's own chat template is used "
                       "(or send raw: true with the prompt already formatted)", "template",
                       code="unsupported_parameter")
    if req.context:
        raise APIError("context: token ids of an earlier exchange are not supported; send the conversation to "
                       "/api/chat as messages", "context", code="unsupported_parameter")
    sampling = _sampling(req.options, "/api/generate")
    if req.raw or req.suffix:
        if req.system:
            raise APIError(f"system with {'raw' if req.raw else 'suffix'}: that prompt is sent as it is, it has no "
                           "system part", "system")
        suffix = {"suffix": req.suffix} if req.suffix else {}
        return CompletionRequest.model_validate({"model": model, "prompt": req.prompt, **suffix,
                                                 **_format(req.format, chat=False), **sampling, **_stream_fields()})
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return ChatCompletionRequest.model_validate({"model": model, "messages": messages, **_format(req.format, chat=True),
                                                 **sampling, **_stream_fields()})


# --- answers out ----------------------------------------------------------------------------
@dataclass(slots=True)
class Piece:
    """A piece of the reply: text, tool calls, or (the last) Ollama's closing fields."""
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    closing: dict | None = None  # done, done_reason, the counts and durations


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _tool_call(call: dict) -> dict:
    """An OpenAI tool call as Ollama's: the arguments an object, not a JSON string."""
    fn = call["function"]
    return {"function": {"name": fn["name"], "arguments": json.loads(fn["arguments"] or "{}")}}


async def _pieces(events: AsyncIterator[str], start: int) -> AsyncIterator[Piece]:
    """An OpenAI stream (chat or completion chunks, with usage) as pieces, the last one closing;
    an error event raises its APIError. `start`: perf_counter_ns when the request arrived."""
    first = finish = None
    async with aclosing(events):  # closed with these pieces, so a client gone aborts the engine request at once
        async for body in sse_bodies(events):
            if "error" in body:
                error = body["error"]
                raise APIError(error.get("message") or "the generation failed",
                               status=500 if error.get("type") == "server_error" else 400)
            for choice in body.get("choices") or []:
                delta = choice.get("delta") or {}
                text = (delta.get("content") if "delta" in choice else choice.get("text")) or ""
                calls = [_tool_call(c) for c in delta.get("tool_calls") or []]
                if text or calls:
                    first = first or time.perf_counter_ns()
                    yield Piece(text, calls)
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
            usage = body.get("usage")
            if usage and finish is not None:
                end = time.perf_counter_ns()
                first = first or end
                yield Piece(closing={
                    "done": True, "done_reason": "length" if finish == "length" else "stop",
                    "total_duration": end - start, "load_duration": 0,
                    "prompt_eval_count": usage["prompt_tokens"], "prompt_eval_duration": first - start,
                    "eval_count": usage["completion_tokens"], "eval_duration": end - first})
                return
    raise APIError("the generation ended without its last chunk", status=500, type="server_error")


def _chat_shape(p: Piece) -> dict:
    message: dict = {"role": "assistant", "content": p.text}
    if p.tool_calls:
        message["tool_calls"] = p.tool_calls
    return {"message": message}


def _generate_shape(p: Piece) -> dict:
    return {"response": p.text}


Shape = Callable[[Piece], dict]


def _line(model: str, shape: Shape, p: Piece) -> dict:
    return {"model": model, "created_at": _now(), **shape(p), **(p.closing or {"done": False})}


async def _ndjson(pieces: AsyncIterator[Piece], model: str, shape: Shape) -> AsyncIterator[str]:
    """One JSON object a line; a failure midway ends the stream with an {"error": ...} line."""
    try:
        async with aclosing(pieces):
            async for p in pieces:
                yield _json_line(_line(model, shape, p))
    except APIError as e:
        yield _json_line({"error": _message(e)})


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


async def _whole(pieces: AsyncIterator[Piece], request: Request) -> Piece:
    """The pieces folded into one, as Ollama answers `stream: false`. A client that leaves first
    ends the generation (ClientGone; its engine request is aborted), as Serving.collect does."""
    texts: list[str] = []
    whole = Piece()

    async def fold() -> None:
        async with aclosing(pieces):
            async for p in pieces:
                texts.append(p.text)
                whole.tool_calls += p.tool_calls
                whole.closing = p.closing or whole.closing

    await unless_gone(request, fold())
    whole.text = "".join(texts)
    return whole


async def _answer(s: ServerState, request: Request, reply: Reply, model: str, shape: Shape, stream: bool,
                  start: int) -> Response:
    pieces = _pieces(reply.content, start)  # (Serving was asked for a stream)
    if stream:  # NDJSON with the event stream's care: a client that stops reading is let go, its request aborted
        return respond(Reply(_ndjson(pieces, model, shape), {**reply.headers, "Content-Type": NDJSON}),
                       s.config.client_read_timeout)
    return JSONResponse(_line(model, shape, await _whole(pieces, request)), headers=reply.headers)


def _message(e: APIError) -> str:
    """The message, with Ollama's names for the options SamplingParams names otherwise."""
    message = e.message
    for name, ollama in _OLLAMA_NAMES.items():
        message = message.replace(name, ollama)
    return message


def _error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": _message(e)}, status_code=e.status)


def _answers_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint whose APIError becomes Ollama's {"error": ...} and whose client left first a 499."""
    @wraps(endpoint)
    async def answered(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as e:
            return _error(e)
        except ClientGone:
            return Response(status_code=499)
    return answered


def _loaded(model: str, shape: Shape) -> JSONResponse:
    """An empty request: Ollama's "load the model" answer (here it is always loaded)."""
    return JSONResponse(_line(model, shape, Piece(closing={"done": True, "done_reason": "load"})))


@_answers_errors
async def chat(request: Request) -> Response:
    start = time.perf_counter_ns()
    s = server_state(request)
    req = await parse_body(request, ChatBody, s.config.max_request_bytes)
    model = _model(s, req.model)
    _refuse_unsupported(req, "/api/chat")
    if not req.messages:
        return _loaded(req.model, _chat_shape)
    reply = await s.serving.chat(_chat_request(req, model), request)
    return await _answer(s, request, reply, req.model, _chat_shape, req.stream, start)


@_answers_errors
async def generate(request: Request) -> Response:
    start = time.perf_counter_ns()
    s = server_state(request)
    req = await parse_body(request, GenerateBody, s.config.max_request_bytes)
    model = _model(s, req.model)
    _refuse_unsupported(req, "/api/generate")
    if not req.prompt and not req.suffix and not req.images:
        return _loaded(req.model, _generate_shape)
    creq = _generate_request(req, model)
    if isinstance(creq, CompletionRequest):  # no num_predict: until the window is full, as on chat
        reply = await s.serving.completions(creq, request, until_full=True)
    else:
        reply = await s.serving.chat(creq, request)
    return await _answer(s, request, reply, req.model, _generate_shape, req.stream, start)


async def _vectors(s: ServerState, request: Request, inputs: list[str], truncate: bool,
                   dimensions: int | None = None) -> tuple[list, int]:
    """Serving.embed's vectors; truncate: each text cut to the window's first tokens, as Ollama does."""
    if truncate:
        window = s.serving.max_model_len
        inputs = [(await s.serving.encode(s.serving.tokenizer.encode, t))[:window] for t in inputs]
    return await s.serving.embed(request, inputs, dimensions=dimensions)


@_answers_errors
async def embed(request: Request) -> Response:
    start = time.perf_counter_ns()
    s = server_state(request)
    req = await parse_body(request, EmbedBody, s.config.max_request_bytes)
    _model(s, req.model)
    check_fields(req, "/api/embed")
    vectors, tokens = await _vectors(s, request, [req.input] if isinstance(req.input, str) else req.input,
                                     req.truncate, req.dimensions)
    return JSONResponse({"model": req.model, "embeddings": vectors, "total_duration": time.perf_counter_ns() - start,
                         "load_duration": 0, "prompt_eval_count": tokens})


@_answers_errors
async def embeddings(request: Request) -> Response:
    """The older /api/embeddings: one prompt, one vector (here the same normalised one as /api/embed's)."""
    s = server_state(request)
    req = await parse_body(request, LegacyEmbedBody, s.config.max_request_bytes)
    _model(s, req.model)
    check_fields(req, "/api/embeddings")
    vectors, _ = await _vectors(s, request, [req.prompt], truncate=True)
    return JSONResponse({"embedding": vectors[0]})


# --- the model, as Ollama describes one -----------------------------------------------------
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    parameters: int
    size: int  # bytes of the weights as the server holds them (a GGUF served in its block formats: about the file)
    quantization: str  # the weight format of most of the parameters ("Q4_1", "Q4_K", "F32", ...)
    format: str  # "gguf", "safetensors" or "pytorch" (a nanochat checkpoint)
    family: str  # the architecture, as GGUF's general.architecture names it where the file is a GGUF


@lru_cache(maxsize=4)
def _facts(engine: LLMEngine) -> ModelFacts:
    """Read once off the loaded model (the server keeps no path to the file it came from)."""
    model, mc = engine.model, engine.model_config
    formats: Counter[str] = Counter()
    for m in model.modules():
        for t in m.parts if isinstance(m, QuantLinear) else [m.table] if isinstance(m, QuantEmbedding) else []:
            formats[t.type_name] += t.shape[0] * t.shape[1]
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        formats[_DTYPES.get(name, name.upper())] += p.numel()
    held = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    extra = mc.extra
    fmt = "gguf" if "gguf_architecture" in extra else "safetensors" if "hf_config" in extra else "pytorch"
    return ModelFacts(parameter_count(model), sum(held.values()), formats.most_common(1)[0][0] if formats else "",
                      fmt, extra.get("gguf_architecture") or mc.architecture)


def _parameter_size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _card(s: ServerState) -> dict:
    """The served model as /api/tags and /api/ps list it."""
    f = _facts(s.serving.engine.engine)
    name = s.config.model_name if ":" in s.config.model_name else s.config.model_name + TAG
    # Ollama's digest hashes the model's manifest; this one names the served model by what it is
    digest = hashlib.sha256(f"{s.config.model_name}\0{f.family}\0{f.parameters}\0{f.size}\0{f.quantization}".encode())
    return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(s.started, UTC).isoformat(),
            "size": f.size, "digest": digest.hexdigest(),
            "details": {"parent_model": "", "format": f.format, "family": f.family, "families": [f.family],
                        "parameter_size": _parameter_size(f.parameters), "quantization_level": f.quantization}}


async def tags(request: Request) -> dict:
    return {"models": [_card(server_state(request))]}


async def ps(request: Request) -> dict:
    s = server_state(request)
    card = _card(s)
    on_gpu = s.serving.engine.engine.device.type != "cpu"
    return {"models": [{**card, "size_vram": card["size"] if on_gpu else 0,
                        "context_length": s.serving.max_model_len}]}


@_answers_errors
async def show(request: Request) -> Response:
    s = server_state(request)
    req = await parse_body(request, ShowBody, s.config.max_request_bytes)
    name = req.model or req.name
    if not name:
        raise APIError("model is required", "model")
    _model(s, name)
    card, f = _card(s), _facts(s.serving.engine.engine)
    mc, arch = s.serving.engine.engine.model_config, f.family
    tokenizer = s.serving.tokenizer
    info = {"general.architecture": arch, "general.parameter_count": f.parameters,
            f"{arch}.context_length": s.serving.max_model_len,  # the served window, which is what fits
            f"{arch}.embedding_length": mc.hidden_size, f"{arch}.block_count": mc.num_layers,
            f"{arch}.attention.head_count": mc.num_heads, f"{arch}.attention.head_count_kv": mc.num_kv_heads,
            f"{arch}.vocab_size": mc.vocab_size}
    # tools: native where the template lists them, else written into the prompt; insert: suffix
    capabilities = ["completion", "tools", "embedding"] + (["insert"] if fim_tokens(tokenizer) is not None else [])
    return JSONResponse({"template": tokenizer.chat_template or "", "parameters": "", "details": card["details"],
                         "model_info": info, "capabilities": capabilities, "modified_at": card["modified_at"]})


async def version(request: Request) -> dict:
    return {"version": __version__}


def _generate_text(req: dict) -> str:
    """/api/generate's prompt as the router reads it: as a chat's when it is templated."""
    prompt = req.get("prompt")
    prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if req.get("raw") or req.get("suffix"):
        return prompt
    system = req.get("system")
    return chat_prompt({"messages": ([{"role": "system", "content": system}] if system else [])
                        + [{"role": "user", "content": prompt}]})


ROUTES = (
    Route("POST", "/api/chat", chat, prompt=chat_prompt),
    Route("POST", "/api/generate", generate, prompt=_generate_text),
    Route("POST", "/api/embed", embed, prompt=lambda req: json.dumps(req.get("input"))),
    Route("POST", "/api/embeddings", embeddings, prompt=lambda req: json.dumps(req.get("prompt"))),
    Route("GET", "/api/tags", tags),
    Route("POST", "/api/show", show),
    Route("GET", "/api/ps", ps),
    Route("GET", "/api/version", version),
)
