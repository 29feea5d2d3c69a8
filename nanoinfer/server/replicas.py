"""`nanoinfer serve --replicas N [--ray-address ADDR]`: N engine replicas as one Ray Serve
application behind one OpenAI-compatible endpoint.

- Each replica (a Ray Serve deployment of its own, `engine-0` .. `engine-{N-1}`, one actor
  each) runs the single server's whole app (create_app) on its own engine: the same API,
  streaming, errors, web page and metrics, because it is the same code. A request reaches
  it as (method, path, query, headers, body) and its response streams back chunk by chunk.
- The router (the ingress deployment, Ray Serve's HTTP proxy in front) picks a replica per
  request, prefix-aware for the routes that generate: the prompt's text, as the route
  declares it (Route.prompt: a completion's prompt, a chat's messages), is cut
  into chunks of PREFIX_CHUNK characters, each chunk hashed with all before it; a request
  goes to the replica that served the longest run of the same chunks (so its prefix cache
  holds them), unless that replica has more than BUSY_SLACK requests in flight beyond the
  least busy one; otherwise, for new prefixes and for routes that do not generate, to the
  least busy (round-robin among equals). `--routing round-robin` turns this off, for comparison.
  A request that refers to state one replica holds (Route.affinity: a `previous_response_id`,
  which names the replica that stored the response) goes to that replica while it is alive.
- /metrics: every replica's metrics with a `replica` label, and the router's own counts.
- A replica that dies fails its in-flight requests (a 503 before the response started, an
  error event in a stream) and gets no new ones for DEAD_BACKOFF_S, while Ray Serve
  restarts it; the others serve on.
- Each replica sizes its default KV pool by the engine's rule on its share of the machine
  (EngineConfig.kv_memory_share = 1/N), and uses cpu_count / N torch threads.

Without an address Ray starts a local instance; with one (`ray://...` or `HOST:PORT`) the
replicas join that cluster. Ray is an optional extra: `pip install 'nanoinfer[ray]'`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import signal
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from .access import AccessPolicy
from .routes import ROUTES, Route, find_route

logger = logging.getLogger("nanoinfer.replicas")

RAY_HINT = "--replicas runs on Ray Serve, which is not installed: pip install 'nanoinfer[ray]' (ray[serve]==2.60.0)"
PREFIX_CHUNK = 64  # characters per hashed chunk of a prompt (about a KV block of text)
PREFIX_CAPACITY = 200_000  # chunk hashes remembered (least recently used forgotten)
BUSY_SLACK = 4  # in-flight requests a prefix's replica may have beyond the least busy one
DEAD_BACKOFF_S = 10.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


@dataclass
class ReplicaSettings:
    model: str | None
    dtype: str
    max_model_len: int | None
    engine: dict  # LLM's engine arguments (cli_args.engine_kwargs)
    server: dict  # ServerConfig's fields
    replicas: int
    speculative_config: dict | None = None
    access: AccessPolicy = field(default_factory=AccessPolicy)  # checked by the router, before any replica
    routes: tuple[Route, ...] = ROUTES  # what every replica serves, and what the router routes by
    threads: int = 1  # CPU threads of each replica: an equal share of --threads (threads.share)


# --- one replica ----------------------------------------------------------------------------
class EngineReplica:
    """The single server's app on its own engine, called request by request."""

    def __init__(self, settings: ReplicaSettings, index: int):
        from .. import threads
        from ..llm import LLM
        from .app import create_app
        from .serving import ServerConfig

        self.index = index
        threads.use(settings.threads)
        logger.info("replica %d: %d CPU thread%s", index, settings.threads, "s" * (settings.threads > 1))
        # the engine's own pool rule, on this replica's share of the machine rather than all of it
        engine = {**settings.engine, "kv_memory_share": 1 / settings.replicas}
        self.llm = LLM(settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
                       speculative_config=settings.speculative_config, **engine)
        self.app = create_app(self.llm.engine, ServerConfig(**settings.server, replica_index=index), settings.routes)
        self.app.state.server.async_engine.start()

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: yields {"status", "headers"}, then the body's
        chunks as the app sends them. Closing this generator (the client left, the router
        cancelled) is a disconnect: the app aborts the request and frees its blocks."""
        queue: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query.encode(), "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
                 "client": ("router", 0), "server": (f"replica-{self.index}", 0)}
        task = asyncio.create_task(self.app(scope, receive, queue.put))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (message := await queue.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": [(k.decode(), v.decode()) for k, v in message.get("headers", [])]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            try:
                await asyncio.wait_for(task, 30)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 (the app logs its own)
                task.cancel()

    async def metrics(self) -> str:
        chunks = [c async for c in self.forward("GET", "/metrics", "", [], b"") if isinstance(c, bytes)]
        return b"".join(chunks).decode()

    async def ping(self) -> int:
        return self.index


# --- routing --------------------------------------------------------------------------------
def _json_object(body: bytes) -> dict | None:
    try:
        req = json.loads(body or b"{}")
    except ValueError:
        return None
    return req if isinstance(req, dict) else None


def routing_text(routes: Sequence[Route], method: str, path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: the prompt, as a generating route declares it
    (Route.prompt); "" (the least busy replica) for every other request."""
    route = find_route(routes, method, path)
    if route is None or route.prompt is None:
        return ""
    req = _json_object(body)
    return route.prompt(req) if req is not None else ""


def pinned_replica(routes: Sequence[Route], method: str, path: str, body: bytes) -> int | None:
    """The replica a request must reach, as its route declares it (Route.affinity: the one that
    stored the response a request continues), or None."""
    route = find_route(routes, method, path)
    if route is None or route.affinity is None:
        return None
    req = _json_object(body)
    return route.affinity(path, req) if req is not None else None


@dataclass
class PrefixTable:
    """Chained chunk hashes -> the replica that last served them (least recently used forgotten)."""
    capacity: int = PREFIX_CAPACITY
    owners: OrderedDict = field(default_factory=OrderedDict)

    @staticmethod
    def chain(text: str) -> list[bytes]:
        out, h = [], b""
        for i in range(0, len(text) - len(text) % PREFIX_CHUNK, PREFIX_CHUNK):
            h = hashlib.blake2b(h + text[i:i + PREFIX_CHUNK].encode(), digest_size=16).digest()
            out.append(h)
        return out

    def longest(self, chain: list[bytes], alive: set[int]) -> tuple[int | None, int]:
        """The replica holding the longest prefix of `chain` (among `alive`), and its length in chunks."""
        best, length = None, 0
        for n, h in enumerate(chain, 1):
            owner = self.owners.get(h)
            if owner is None:
                break
            if owner in alive:
                best, length = owner, n
        return best, length

    def record(self, chain: list[bytes], replica: int) -> None:
        for h in chain:
            self.owners[h] = replica
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)


@dataclass
class RouterState:
    replicas: int
    policy: str = "prefix"  # "prefix" | "round-robin"
    in_flight: list[int] = field(default_factory=list)
    dead_until: list[float] = field(default_factory=list)
    table: PrefixTable = field(default_factory=PrefixTable)
    next_rr: int = 0
    routed: Counter = field(default_factory=Counter)  # (replica, how) -> requests

    def __post_init__(self) -> None:
        self.in_flight = [0] * self.replicas
        self.dead_until = [0.0] * self.replicas

    def alive(self) -> set[int]:
        now = time.monotonic()
        return {i for i in range(self.replicas) if self.dead_until[i] <= now}

    def choose(self, text: str, pinned: int | None = None) -> int:
        """The replica for a request whose prompt is `text`: `pinned` (Route.affinity) if it is
        alive, else by prefix and load. A pinned replica that is dead (or unknown) gets no request:
        the replica chosen instead answers that it holds nothing of the kind."""
        alive = self.alive() or set(range(self.replicas))
        if pinned is not None and pinned in alive:
            self.routed[(pinned, "affinity")] += 1
            return pinned
        chain = PrefixTable.chain(text)
        how = "round_robin"
        if self.policy == "round-robin":
            pick = self._next(alive)
        else:
            owner, _ = self.table.longest(chain, alive)
            least = min(self.in_flight[i] for i in alive)
            if owner is not None and self.in_flight[owner] <= least + BUSY_SLACK:
                pick, how = owner, "prefix"
            else:
                pick, how = self._next({i for i in alive if self.in_flight[i] == least}), "least_busy"
            self.table.record(chain, pick)
        self.routed[(pick, how)] += 1
        return pick

    def _next(self, among: set[int]) -> int:
        for k in range(self.replicas):
            i = (self.next_rr + k) % self.replicas
            if i in among:
                self.next_rr = i + 1
                return i
        return min(among)


def labelled(text: str, replica: int, seen: set[str]) -> list[str]:
    """A replica's Prometheus text with replica="i" on every sample; HELP/TYPE lines once."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                out.append(line)
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, rest = m.groups()
        inner = f'replica="{replica}"' + ("," + labels[1:-1] if labels and labels != "{}" else "")
        out.append(f"{name}{{{inner}}}{rest}")
    return out


class Router:
    """The ingress: routes each HTTP request to a replica and streams its response back."""

    def __init__(self, settings: ReplicaSettings, policy: str, *engines):
        self.engines = list(engines)
        self.state = RouterState(len(engines), policy)
        self.access = settings.access
        self.routes = settings.routes

    async def __call__(self, request):
        from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

        path = request.url.path
        lower = {k.lower(): v for k, v in request.headers.items()}
        refusal = self.access.check(request.method, path, lower)  # keys, Host, origins, JSON: before any replica
        if refusal is not None:
            return Response(refusal.encoded() if refusal.status != 204 else b"", status_code=refusal.status,
                            headers=refusal.headers)
        cors = self.access.cors_headers(lower.get("origin"))
        body = await request.body()
        if path == "/metrics":
            return PlainTextResponse(await self._metrics(), media_type="text/plain; version=0.0.4", headers=cors)
        i = self.state.choose(routing_text(self.routes, request.method, path, body),
                              pinned_replica(self.routes, request.method, path, body))
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        gen = self.engines[i].options(stream=True).forward.remote(request.method, path, request.url.query, headers, body)
        self.state.in_flight[i] += 1
        try:
            head = await gen.__anext__()
        except Exception as e:  # noqa: BLE001 (the replica died or could not start)
            self.state.in_flight[i] -= 1
            return JSONResponse(self._failed(i, e), status_code=503)

        async def rest() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for chunk in gen:
                    yield chunk
                finished = True
            except Exception as e:  # noqa: BLE001 (the replica died mid-response)
                yield f"data: {json.dumps(self._failed(i, e))}\n\ndata: [DONE]\n\n".encode()
            finally:
                self.state.in_flight[i] -= 1
                if not finished:
                    gen.cancel()  # the client left: the replica aborts the request

        keep = [(k, v) for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")]
        return StreamingResponse(rest(), status_code=head["status"], headers={**dict(keep), **cors})

    def _failed(self, i: int, e: Exception) -> dict:
        self.state.dead_until[i] = time.monotonic() + DEAD_BACKOFF_S
        logger.warning("replica %d failed a request: %s", i, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return {"error": {"message": f"replica {i} failed while serving the request; retry",
                          "type": "server_error", "param": None, "code": "replica_failed"}}

    async def _metrics(self) -> str:
        lines: list[str] = []
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            try:
                text = await engine.metrics.remote()
            except Exception:  # noqa: BLE001 (a dead replica has no metrics)
                continue
            lines += labelled(text, i, seen)
        lines += ["# HELP nanoinfer_router_requests_total Requests the router sent to each replica, by how it chose",
                  "# TYPE nanoinfer_router_requests_total counter"]
        lines += [f'nanoinfer_router_requests_total{{replica="{r}",how="{how}"}} {n}'
                  for (r, how), n in sorted(self.state.routed.items())]
        lines += ["# HELP nanoinfer_router_in_flight Requests in flight per replica", "# TYPE nanoinfer_router_in_flight gauge"]
        lines += [f'nanoinfer_router_in_flight{{replica="{r}"}} {n}' for r, n in enumerate(self.state.in_flight)]
        return "\n".join(lines) + "\n"


# --- starting it ----------------------------------------------------------------------------
def serve_replicas(settings: ReplicaSettings, host: str, port: int, ray_address: str | None, policy: str) -> None:
    """Start (or join) Ray, deploy the replicas and the router, and serve until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError:
        from ..errors import NanoinferError
        raise NanoinferError(RAY_HINT) from None

    # Ray Serve gives its HTTP proxy 5 s to come up; a loaded small machine can need more.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(address=ray_address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=True,
             logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    no_cpu = {"num_cpus": 0}  # scheduling by CPU would serialise replicas on a small machine
    replica = serve.deployment(EngineReplica, ray_actor_options=no_cpu, max_ongoing_requests=1000,
                               health_check_period_s=2, graceful_shutdown_timeout_s=5)
    engines = [replica.options(name=f"engine-{i}").bind(settings, i) for i in range(settings.replicas)]
    router = serve.deployment(Router, name="router", ray_actor_options=no_cpu, max_ongoing_requests=10_000)
    serve.run(router.bind(settings, policy, *engines), name="nanoinfer", route_prefix="/")
    logger.warning("serving %d replicas on http://%s:%d (Ray Serve; routing: %s)", settings.replicas, host, port, policy)
    print(f"[nanoinfer: {settings.replicas} replicas on http://{host}:{port}, routing {policy}]", flush=True)

    def stop(*_) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGINT, stop)  # (Ray's driver set-up replaces Python's own SIGINT handling)
    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    finally:
        import psutil

        started = psutil.Process().children(recursive=True)  # the local Ray we started, if any
        serve.shutdown()
        ray.shutdown()
        # Ray's per-node agents can outlive a local instance's shutdown: end what is left of it.
        _, alive = psutil.wait_procs(started, timeout=10)
        for p in alive:
            p.kill()

