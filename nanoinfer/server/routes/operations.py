"""/health and /metrics: for load balancers and Prometheus."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..state import server_state
from .base import Route


async def health(request: Request) -> dict | JSONResponse:
    # Reads two attributes: never waits for the engine, so it answers while the engine is busy.
    s = server_state(request)
    engine = s.async_engine
    if engine.error is not None or not engine.thread.is_alive():
        why = repr(engine.error) if engine.error else "engine thread is not running"
        return JSONResponse({"status": "error", "error": why}, status_code=503)
    m = engine.metrics
    return {"status": "ok", "model": s.config.model_name, "running": m["running"], "waiting": m["waiting"]}


async def prometheus(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


ROUTES = (
    Route("GET", "/health", health),
    Route("GET", "/metrics", prometheus),
)
