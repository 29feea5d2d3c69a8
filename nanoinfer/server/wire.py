"""What a route reads off the wire and writes back: request bodies in (a size limit checked as the
bytes arrive, large bodies parsed off the event loop), JSON or a server-sent event stream out (a
stream whose client stops reading is closed, and its engine request aborted)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from .protocol import APIError, Strict, parse_request
from .serving import Reply

logger = logging.getLogger("nanoinfer.server")
_DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, so the 413 reaches the client
_PARSE_INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (well under a millisecond)


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


async def parse_body(request: Request, model: type[Strict], limit: int) -> Any:
    """The body as a `model`, or APIError (400 naming the field, 413 over `limit` bytes)."""
    raw = await read_body(request, limit)
    if len(raw) > _PARSE_INLINE_BYTES:  # linear, but a megabyte still takes milliseconds: not on the loop
        return await asyncio.to_thread(parse_request, model, raw)
    return parse_request(model, raw)


def respond(reply: Reply, send_timeout: float) -> JSONResponse | SSEResponse:
    """A JSON body as JSON; a stream as server-sent events, each write waiting at most `send_timeout`."""
    if isinstance(reply.content, dict):
        return JSONResponse(reply.content, headers=reply.headers)
    return SSEResponse(reply.content, send_timeout, reply.headers)


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
