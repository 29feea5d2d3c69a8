"""Adding an endpoint from outside the package: a toy route that generates from a prompt is one
Route declaration with its `prompt`; the app serves it (behind the same access checks), and the
replica router routes it prefix-aware without a line of replicas.py changing. A toy route that
does not generate is routed to the least busy replica, whatever its body holds."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx2 as httpx
from fastapi import Request

from nanoinfer import LLM
from nanoinfer.server import ServerConfig, create_app
from nanoinfer.server.access import AccessPolicy
from nanoinfer.server.protocol import CompletionRequest
from nanoinfer.server.replicas import ReplicaSettings, Router
from nanoinfer.server.routes import ROUTES, Route
from nanoinfer.server.state import server_state
from nanoinfer.server.wire import parse_body

from server_utils import serve_in_thread


# --- the toy endpoints: what a user of the package writes ---------------------------------------
async def toy(request: Request) -> dict:
    """A completion of the prompt, shouted."""
    s = server_state(request)
    req = await parse_body(request, CompletionRequest, s.config.max_request_bytes)
    reply = await s.serving.completions(req, request)
    return {"toy": reply.content["choices"][0]["text"].upper()}


async def count(request: Request) -> dict:
    """The prompt's length in characters: reads a prompt, generates nothing."""
    s = server_state(request)
    req = await parse_body(request, CompletionRequest, s.config.max_request_bytes)
    return {"chars": len(req.prompt)}


TOY_ROUTES = (*ROUTES,
              Route("POST", "/v1/toy", toy, prompt=lambda req: str(req.get("prompt", ""))),
              Route("POST", "/v1/toy/count", count))


# --- the router, without Ray: stand-ins for the replicas' deployment handles --------------------
class FakeReplica:
    """Answers `options(stream=True).forward.remote(...)` as a replica's handle does, and notes the path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.forward = self

    def options(self, stream: bool) -> FakeReplica:
        return self

    def remote(self, method: str, path: str, query: str, headers: list, body: bytes):
        self.paths.append(path)

        async def response():
            yield {"status": 200, "headers": [("content-type", "application/json")]}
            yield b"{}"

        return response()


def send(router: Router, path: str, body: dict) -> int:
    """POST `body` through the router; the replica it went to."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "scheme": "http",
             "server": ("localhost", 8000), "headers": [(b"host", b"localhost"), (b"content-type", b"application/json")]}

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def run() -> None:
        response = await router(Request(scope, receive))
        async for _ in response.body_iterator:  # the whole response: the replica is no longer busy
            pass

    before = [len(r.paths) for r in router.engines]
    asyncio.run(run())
    return next(i for i, r in enumerate(router.engines) if len(r.paths) > before[i])


def test_the_declared_routes_that_generate():
    assert {r.path for r in ROUTES if r.prompt is not None} == {"/v1/completions", "/v1/chat/completions",
                                                                 "/v1/messages", "/completion", "/infill",
                                                                 "/api/chat", "/api/generate", "/v1/responses",
                                                                 "/v1/embeddings", "/api/embed", "/api/embeddings"}


def test_a_toy_generating_route_is_routed_by_its_prompt_prefix():
    settings = ReplicaSettings(None, "auto", None, {}, {}, replicas=2, routes=TOY_ROUTES)
    router = Router(settings, "prefix", FakeReplica(), FakeReplica())
    systems = [f"You are toy assistant number {k}. " * 4 for k in range(5)]  # two 64-character chunks each
    first = [send(router, "/v1/toy", {"prompt": f"{s}question 0"}) for s in systems]
    assert sorted(first) == [0, 0, 0, 1, 1]  # new prefixes spread over the least busy (round-robin)
    for turn in range(1, 4):  # each prompt's later turns go where its first went
        assert [send(router, "/v1/toy", {"prompt": f"{s}question {turn}"}) for s in systems] == first
    assert sum(n for (_, how), n in router.state.routed.items() if how == "prefix") == 3 * len(systems)

    # One prompt, again and again, to the route that does not generate: the least busy replica
    # (round-robin among equals, both idle here), not the prompt's; the prefix table is not touched.
    table = dict(router.state.table.owners)
    before = Counter(router.state.routed)
    picks = [send(router, "/v1/toy/count", {"prompt": f"{systems[0]}question 0"}) for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]
    assert {how for _, how in Counter(router.state.routed) - before} == {"least_busy"}
    assert router.state.table.owners == table


def test_the_app_serves_the_toy_routes_behind_its_access_checks(llama_dir):
    llm = LLM(llama_dir)
    key = {"Authorization": "Bearer k"}
    app = create_app(llm.engine, ServerConfig(model_name="m", access=AccessPolicy(api_keys=("k",))), TOY_ROUTES)
    with serve_in_thread(app) as url:
        body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0}
        assert httpx.post(f"{url}/v1/toy", json=body, timeout=10).status_code == 401  # a new route is covered
        plain = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=30).json()["choices"][0]["text"]
        r = httpx.post(f"{url}/v1/toy", json=body, headers=key, timeout=30)
        assert r.status_code == 200 and r.json() == {"toy": plain.upper()}
        assert httpx.post(f"{url}/v1/toy/count", json=body, headers=key, timeout=10).json() == {"chars": 11}
        bad = httpx.post(f"{url}/v1/toy", json={"prompt": 3.5}, headers=key, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"  # the server's error shape
