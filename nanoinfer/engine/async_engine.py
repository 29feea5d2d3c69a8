"""The engine on its own thread, for servers: asyncio in front, the step loop behind.

Request handlers never run model code on the event loop. They put commands (add,
abort) on a thread-safe queue; the engine thread applies them between steps, runs
`step()`, and hands each request's deltas back to its asyncio queue with
`call_soon_threadsafe`. A handler that stops listening (client gone) aborts its
request, which frees its KV blocks at the next step boundary.

Backpressure: a request whose reader is more than `max_buffered` deltas behind is paused
(not scheduled, its KV kept) until the reader catches up to half of that; one paused for
`stall_timeout` seconds is aborted, which frees its KV. So a client that stops reading holds
a bounded buffer, and only for a while.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..sampling import SamplingParams
from .core import LLMEngine
from .outputs import RequestOutput, StreamDelta


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    priority: int = 0


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Resume:
    request_id: str


@dataclass
class _Stream:
    """One request's way back to its handler, and how far the handler has read."""
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: int = 0  # items handed to the sink (engine thread)
    read: int = 0  # items the handler took (event loop; read here without a lock: a torn read is only stale)
    paused_at: float | None = None  # when it was paused for a slow reader


_FINISHED = object()  # sentinel closing a request's stream; followed by nothing
logger = logging.getLogger("nanoinfer.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_buffered: int = 64, stall_timeout: float = 30.0):
        self.engine = engine
        self.max_buffered, self.stall_timeout = max_buffered, stall_timeout
        self.commands: queue.Queue = queue.Queue()
        self.sinks: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.metrics: dict = engine.metrics()  # a snapshot, replaced by the engine thread after each step
        self.error: BaseException | None = None
        # Called on the engine thread with each request's final output, including requests whose
        # client left (nobody reads their stream any more): servers count them in their metrics.
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.thread = threading.Thread(target=self._run, name="nanoinfer-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # --- the engine thread ------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_schedulable():  # idle, or every request paused: sleep until a command
                try:
                    self._apply(self.commands.get(timeout=self._next_stall_check()))
                except queue.Empty:
                    pass
            while not self.commands.empty():
                self._apply(self.commands.get_nowait())
            self._abort_stalled()
            if self.engine.has_schedulable():
                steps = self.engine.total_steps
                try:
                    deltas = self.engine.step()
                except Exception as e:  # a bug in a step must not leave clients hanging
                    self.error = e
                    for rid in list(self.sinks):
                        self._apply(_Abort(rid))
                    continue
                for d in deltas:
                    self._send(d.request_id, d)
                for rid, error in self.engine.take_failures().items():  # ended alone; the rest go on
                    self._close(rid, error)
                # Close a request only after all of this step's deltas went out: the n samples
                # of one request often finish in the same step, and closing at the first one
                # would drop the others' last deltas and then look up a released request.
                for rid in dict.fromkeys(d.request_id for d in deltas if d.finished):
                    if rid in self.engine.requests and self.engine.output(rid).finished:
                        self._close(rid)
                if self.engine.total_steps == steps:  # nothing could run (no blocks free): wait for a change
                    try:
                        self._apply(self.commands.get(timeout=0.05))
                    except queue.Empty:
                        pass
            self.metrics = self.engine.metrics()

    def _next_stall_check(self) -> float | None:
        """Seconds until the first paused request would reach its stall timeout (None: none paused)."""
        paused = [s.paused_at for s in self.sinks.values() if s.paused_at is not None]
        return max(0.0, min(paused) + self.stall_timeout - time.monotonic()) if paused else None

    def _abort_stalled(self) -> None:
        now = time.monotonic()
        for rid, stream in list(self.sinks.items()):
            if stream.paused_at is not None and now - stream.paused_at >= self.stall_timeout:
                logger.warning("request %s aborted: its client read nothing for %.0f s", rid, self.stall_timeout)
                self._apply(_Abort(rid))

    def _apply(self, cmd) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Add):
            if cmd.request_id in self.sinks:  # a duplicate id must not take over the running request's sink
                cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, ValueError(
                    f"request id {cmd.request_id!r} is already in use"))
                return
            self.sinks[cmd.request_id] = _Stream(cmd.sink, cmd.loop)
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.prompt, cmd.priority)
            except Exception as e:
                self._send(cmd.request_id, e)
                self.sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _Abort) and cmd.request_id in self.engine.requests:
            for d in self.engine.abort(cmd.request_id):
                self._send(cmd.request_id, d)
            self._close(cmd.request_id)
        elif isinstance(cmd, _Resume):
            stream = self.sinks.get(cmd.request_id)
            if stream is not None and stream.paused_at is not None:
                stream.paused_at = None
                self.engine.pause(cmd.request_id, False)

    def _send(self, rid: str, item) -> None:
        stream = self.sinks.get(rid)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.sink.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            return
        stream.sent += 1
        if stream.paused_at is None and stream.sent - stream.read > self.max_buffered and rid in self.engine.requests:
            stream.paused_at = time.monotonic()
            self.engine.pause(rid)

    def _close(self, rid: str, error: Exception | None = None) -> None:
        """Release the request and end its stream: with its final output, or with the error that ended it."""
        out = self.engine.release(rid)
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # a metrics bug must not stop the engine
                pass
        self._send(rid, out if error is None else error)
        self._send(rid, _FINISHED)
        self.sinks.pop(rid, None)

    # --- the asyncio side -------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000)}"

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[StreamDelta | RequestOutput]:
        """Yield this request's deltas as they come, then its final RequestOutput.
        Raises the engine's error if the request is refused. Closing early aborts it."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down")
        rid = request_id or self.new_request_id()
        sink: asyncio.Queue = asyncio.Queue()
        self.commands.put(_Add(rid, prompt_ids, params, prompt, sink, asyncio.get_running_loop(), priority))
        finished = False
        read = 0
        try:
            while True:
                item = await sink.get()
                read += 1
                stream = self.sinks.get(rid)
                if stream is not None:
                    stream.read = read
                    if stream.paused_at is not None and stream.sent - read <= self.max_buffered // 2:
                        self.commands.put(_Resume(rid))
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self.commands.put(_Abort(rid))

    def abort(self, request_id: str) -> None:
        self.commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, then abort the rest."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self.sinks):
            self.commands.put(_Abort(rid))
        self.commands.put(None)
        time.sleep(0.1)
        self._stop.set()
        self.commands.put(None)
        self.thread.join(timeout=5)

    def abort_all(self) -> None:
        """Abort every request in flight (from any thread): each stream gets its "abort" ending."""
        for rid in list(self.sinks):
            self.commands.put(_Abort(rid))
