"""The FastAPI app: OpenAI-compatible endpoints, health, metrics, tokenizer endpoints and the
chat page, in front of one engine on its own thread.

    create_app(engine, config)  ->  FastAPI app (the engine thread starts with the app's lifespan)
    serve(engine, config, host, port)  ->  runs it under uvicorn until SIGINT/SIGTERM

Shutdown is graceful: uvicorn stops accepting connections and gives in-flight requests
`config.shutdown_timeout` seconds, then cancels them (each cancel aborts its engine request);
the lifespan's exit then stops and joins the engine thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..async_engine import AsyncEngine
from ..engine import LLMEngine
from ..errors import InvalidRequestError
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       message_dicts, parse_request)
from .serving import ClientGone, ServerConfig, Serving

logger = logging.getLogger("nanoinfer.server")
STATIC = Path(__file__).parent / "static"
_DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, so the 413 reaches the client


class SSEResponse(StreamingResponse):
    """A text/event-stream whose generator is always closed: on a client disconnect (noticed by
    listening for it, not only when a write fails) or when the response task is cancelled,
    `aclose()` runs the generator's cleanup, which aborts the engine request."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 if it is over `limit` bytes (checked as it arrives, not only by Content-Length)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > _DRAIN_LIMIT:
        raise APIError(f"the request body is {declared} bytes; this server's limit is {limit}", None, status=413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT:
                break
    except ClientDisconnect:  # gone before the body arrived: nobody to answer
        raise APIError("the client disconnected", status=499) from None
    if size > limit:
        raise APIError(f"the request body is over this server's limit of {limit} bytes", None, status=413)
    return b"".join(chunks)


def create_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.metrics)
    async_engine.on_finished = metrics.observe  # every request, also those whose client left
    serving = Serving(async_engine, config)
    tokenizer = engine.tokenizer
    started = int(time.time())
    page = (STATIC / "index.html").read_bytes()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        logger.info("engine thread started: model %s, context %d", config.model_name, engine.max_model_len)
        try:
            yield
        finally:
            # uvicorn has already waited for (or cancelled) in-flight requests; abort what is left.
            await asyncio.to_thread(async_engine.shutdown, 1.0)
            logger.info("engine thread stopped")

    # No /docs: Swagger UI loads from a CDN, and this server loads nothing from outside.
    app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(str(e.detail), status=e.status_code, type=kind).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(f"internal error: {type(e).__name__}", status=500, type="server_error").body(),
                            status_code=500)

    async def body(request: Request, model):
        return parse_request(model, await read_body(request, config.max_request_bytes))

    def respond(result):
        return SSEResponse(result) if not isinstance(result, dict) else JSONResponse(result)

    # --- OpenAI ----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await body(request, CompletionRequest)
        try:
            return respond(await serving.completions(req, request))
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await body(request, ChatCompletionRequest)
        try:
            return respond(await serving.chat(req, request))
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": started, "owned_by": "nanoinfer",
            "max_model_len": engine.max_model_len,
        }]}

    # --- operations ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        # Reads two attributes: never waits for the engine, so it answers while the engine is busy.
        if async_engine.error is not None or not async_engine.thread.is_alive():
            why = repr(async_engine.error) if async_engine.error else "engine thread is not running"
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        m = async_engine.metrics
        return {"status": "ok", "model": config.model_name, "running": m["running"], "waiting": m["waiting"]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await body(request, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give either prompt or messages", "prompt")
        try:
            if req.prompt is not None:
                ids = await serving.encode(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
            else:
                if not req.messages:
                    raise APIError("messages must be a non-empty list", "messages")
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                ids = await serving.encode(tokenizer.encode_chat, message_dicts(req.messages),
                                           add_generation_prompt=req.add_generation_prompt, tools=tools,
                                           **(req.chat_template_kwargs or {}))
        except InvalidRequestError as e:
            raise APIError(str(e), "prompt" if req.prompt is not None else "messages") from None
        except TypeError as e:
            raise APIError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await body(request, DetokenizeRequest)
        serving.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # --- the chat page ---------------------------------------------------------------
    @app.get("/")
    async def index():
        return Response(page, media_type="text/html; charset=utf-8")

    return app


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    import uvicorn

    app = create_app(engine, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=config.shutdown_timeout)
