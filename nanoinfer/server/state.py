"""What the routes reach: one ServerState per app, built by create_app and kept on
`app.state.server`; a route gets it with `server_state(request)`."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from ..engine.async_engine import AsyncEngine
from .metrics import ServerMetrics
from .response_store import ResponseStore
from .serving import ServerConfig, Serving


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    async_engine: AsyncEngine  # the engine on its thread: health reads its state, serving submits to it
    serving: Serving  # requests -> prompts and SamplingParams -> the engine -> OpenAI's responses
    metrics: ServerMetrics
    started: int  # seconds since the epoch: the model card's "created"
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's (routes/responses.py)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
