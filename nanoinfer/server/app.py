"""The FastAPI app: OpenAI-compatible endpoints, health, metrics, tokenizer endpoints and the
chat page, in front of one engine on its own thread.

    create_app(engine, config)  ->  FastAPI app (the engine thread starts with the app's lifespan)
    serve(engine, config, host, port)  ->  runs it under uvicorn until SIGINT/SIGTERM

Shutdown is graceful: uvicorn stops accepting connections and gives in-flight requests
`config.shutdown_timeout` seconds; then their engine requests are aborted, so each ends as if it
had finished (finish_reason "abort", streams with `data: [DONE]`), and only a request still
running _ABORT_GRACE seconds later is cancelled. The lifespan's exit then stops and joins the
engine thread. A connection that has not sent a request's headers within `config.header_timeout`
seconds is closed.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine import LLMEngine
from ..engine.async_engine import AsyncEngine
from ..errors import InvalidRequestError
from .access import AccessMiddleware
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    message_dicts,
    parse_request,
)
from .serving import ClientGone, Reply, ServerConfig, Serving, as_api_error

logger = logging.getLogger("nanoinfer.server")
STATIC = Path(__file__).parent / "static"
_DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, so the 413 reaches the client
SEND_BUFFER_BYTES = 64 << 10  # a connection's kernel send buffer (Linux doubles it); ample for token streams
_PARSE_INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (well under a millisecond)
_ABORT_GRACE = 3.0  # seconds aborted requests get to send their last chunks before uvicorn cancels them


class SSEResponse(StreamingResponse):
    """A text/event-stream whose generator is always closed: on a client disconnect (noticed by
    listening for it, not only when a write fails), when the response task is cancelled, or when
    one write waits more than `send_timeout` seconds for a client that stopped reading (the
    connection is then closed), `aclose()` runs the generator's cleanup, which aborts the engine
    request."""

    def __init__(self, content, send_timeout: float, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except TimeoutError:
                raise _ClientStalled() from None

        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(timed_send)
                    except OSError:  # the client went away mid-write
                        pass
                    except _ClientStalled:
                        logger.warning("a client read nothing for %.0f s: its stream is closed", self.send_timeout)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


class _ClientStalled(Exception):
    pass


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
    async_engine = AsyncEngine(engine, stall_timeout=config.client_read_timeout)
    metrics = ServerMetrics(lambda: async_engine.metrics)
    async_engine.on_finished = metrics.observe  # every request, also those whose client left
    serving = Serving(async_engine, config)
    tokenizer = engine.tokenizer
    started = int(time.time())
    page = (STATIC / "index.html").read_bytes()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(engine.structured.warm_up)  # before serving: it holds the GIL a while
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
    app.add_middleware(AccessMiddleware, policy=config.access)
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
        error = as_api_error(e)
        return JSONResponse(error.body(), status_code=error.status)

    async def body(request: Request, model):
        raw = await read_body(request, config.max_request_bytes)
        if len(raw) > _PARSE_INLINE_BYTES:  # linear, but a megabyte still takes milliseconds: not on the loop
            return await asyncio.to_thread(parse_request, model, raw)
        return parse_request(model, raw)

    def respond(reply: Reply):
        if isinstance(reply.content, dict):
            return JSONResponse(reply.content, headers=reply.headers)
        return SSEResponse(reply.content, config.client_read_timeout, reply.headers)

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

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": started, "owned_by": "nanoinfer",
                "max_model_len": engine.max_model_len,
                # native: the chat template lists tools; injected: the server writes them into the prompt
                "tool_calling": "native" if tokenizer.native_tools else "injected"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return model_card()

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
                ids = await serving.encode(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens,
                                           parse_special=req.parse_special is not False)
            else:
                if not req.messages:
                    raise APIError("messages must be a non-empty list", "messages")
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                messages, tools = serving.template_input(message_dicts(req.messages), tools)
                ids = await serving.encode(tokenizer.encode_chat, messages,
                                           add_generation_prompt=req.add_generation_prompt, tools=tools,
                                           parse_special=req.parse_special is True, **(req.chat_template_kwargs or {}))
        except InvalidRequestError as e:
            raise APIError(str(e), e.param or ("prompt" if req.prompt is not None else "messages")) from None
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


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection which has not sent a whole request's headers
    `header_timeout` seconds after connecting or after its last response. (uvicorn's keep-alive
    timer is reset by every byte received, so a client trickling headers held a connection forever.)
    Its socket's send buffer is fixed at SEND_BUFFER_BYTES: with the kernel's autotuning a client
    that stops reading soaked up megabytes of a stream before a write waited, so the server could
    not tell it had stopped (the stream's own buffer then fills: see AsyncEngine)."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._header_timer is not None:  # the headers are in
            self._header_timer.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # for the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _header_timeout_expired(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, aborting the engine requests still running `abort_after` seconds into
    its graceful shutdown, so that they end as the README promises rather than being cancelled."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, abort_after: float):
        super().__init__(config)
        self.async_engine, self.abort_after = async_engine, abort_after

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.abort_after, self.async_engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    app = create_app(engine, config)
    protocol = type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": config.header_timeout})
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, loop="asyncio",
                               timeout_graceful_shutdown=config.shutdown_timeout + _ABORT_GRACE)
    _Server(uv_config, app.state.async_engine, config.shutdown_timeout).run()
