"""The FastAPI app: the routes of `routes/` (OpenAI-compatible endpoints, health, metrics,
tokenizer endpoints and the chat page) in front of one engine on its own thread.

    create_app(engine, config, routes=ROUTES)  ->  FastAPI app (the engine thread starts with its lifespan)
    serve(engine, config, host, port)  ->  runs it under uvicorn until SIGINT/SIGTERM

create_app only assembles: the engine thread and what the routes reach (ServerState, on
app.state.server), the lifespan, the error handlers, the access checks, and the route table.

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
from collections.abc import Sequence
from contextlib import asynccontextmanager

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine import LLMEngine
from ..engine.async_engine import AsyncEngine
from .access import AccessMiddleware
from .metrics import ServerMetrics
from .protocol import APIError
from .routes import ROUTES, Route, served_families
from .serving import ServerConfig, Serving, as_api_error
from .state import ServerState

logger = logging.getLogger("nanoinfer.server")
SEND_BUFFER_BYTES = 64 << 10  # a connection's kernel send buffer (Linux doubles it); ample for token streams
_ABORT_GRACE = 3.0  # seconds aborted requests get to send their last chunks before uvicorn cancels them


def create_app(engine: LLMEngine, config: ServerConfig, routes: Sequence[Route] = ROUTES) -> FastAPI:
    async_engine = AsyncEngine(engine, stall_timeout=config.client_read_timeout)
    metrics = ServerMetrics(lambda: async_engine.metrics)
    async_engine.on_finished = metrics.observe  # every request, also those whose client left
    state = ServerState(config, async_engine, Serving(async_engine, config), metrics, started=int(time.time()))

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
            for disk in engine.disk_caches:  # the persistent prefix cache's last blocks onto disk
                await asyncio.to_thread(disk.close)
            logger.info("engine thread stopped")

    # No /docs: Swagger UI loads from a CDN, and this server loads nothing from outside.
    app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, policy=config.access)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = str(e.detail)
        if e.status_code == 404 and message == "Not Found":  # no route: say which APIs are here
            message = (f"no route {request.method} {request.url.path}; this server serves {served_families(routes)}")
        return JSONResponse(APIError(message, status=e.status_code, type=kind).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        error = as_api_error(e)
        return JSONResponse(error.body(), status_code=error.status)

    for route in routes:
        # response_model=None: an endpoint's return annotation documents it; FastAPI must not validate by it
        app.add_api_route(route.path, route.endpoint, methods=[route.method], response_model=None)
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
    _Server(uv_config, app.state.server.async_engine, config.shutdown_timeout).run()
