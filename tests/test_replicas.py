"""`serve --replicas 2` on Ray Serve (a local Ray instance), driven by the official openai client:
concurrent streams with disconnects give the single server's greedy outputs, every replica's KV
blocks return to zero, a replica killed mid-load fails its in-flight requests cleanly while the
survivor serves new ones; and the router's prefix-aware choice, unit by unit."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from nanoinfer.server.replicas import BUSY_SLACK, PrefixTable, RouterState, labelled, routing_text
from nanoinfer.server.routes import ROUTES

from server_utils import run_server

ray = pytest.importorskip("ray", reason="Ray Serve is the [ray] extra")
openai = pytest.importorskip("openai")


def prompts(n: int) -> list[str]:
    words = ["alpha", "brown", "cloud", "delta", "ember", "fjord", "grove", "harbor", "island", "jungle"]
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 5)) for i in range(n)]


def per_replica(metrics_text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{replica="(\d+)"[^}}]*}} (\S+)$', metrics_text, re.M)}


async def stream_all(url: str, texts: list[str], max_tokens: int, leave_after: set[int]) -> list[str | None]:
    """Stream every prompt at once; the ones in `leave_after` close their stream after the first chunk."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    async def one(i: int, text: str) -> str | None:
        stream = await client.completions.create(model="m", prompt=text, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        out = []
        async for chunk in stream:
            out.append(chunk.choices[0].text if chunk.choices else "")
            if i in leave_after:
                await stream.close()
                return None
        return "".join(out)

    try:
        return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    finally:
        await client.close()


def test_two_replicas_behind_one_endpoint(llama_dir):
    import httpx2 as httpx
    import psutil

    texts = prompts(32)
    with run_server(["--model", str(llama_dir), "--served-model-name", "m"]) as url:
        single = asyncio.run(stream_all(url, texts, 24, set()))
    # the clients send api_key "x": the router checks it (and Host, origins, content types) as the single server does
    with run_server(["--model", str(llama_dir), "--served-model-name", "m", "--replicas", "2", "--api-key", "x"],
                    startup_timeout=240) as url:
        key = {"Authorization": "Bearer x"}
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=key, timeout=10).status_code == 200
        assert httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a"}', timeout=10,
                          headers={**key, "Content-Type": "text/plain"}).status_code == 415
        assert httpx.get(f"{url}/health", headers={"Host": "attacker.example"}, timeout=10).status_code == 403
        got = asyncio.run(stream_all(url, texts, 24, leave_after={3, 9, 14, 20, 27}))
        for i, (a, b) in enumerate(zip(got, single)):
            assert a is None or a == b, i
        assert sum(a is not None for a in got) == 27

        deadline = time.monotonic() + 30
        while True:  # the disconnected requests are aborted and every block freed, on both replicas
            text = httpx.get(f"{url}/metrics", headers=key, timeout=10).text
            used, steps = per_replica(text, "nanoinfer_kv_cache_blocks_used"), per_replica(text, "nanoinfer_engine_steps_total")
            if set(used) == {"0", "1"} and not any(used.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert used == {"0": 0.0, "1": 0.0}
        assert steps["0"] > 0 and steps["1"] > 0  # both replicas worked
        assert 'nanoinfer_router_requests_total{replica="1"' in text

        # A replica dies under load: its requests fail cleanly, the other's finish, new ones are served.
        victim = next(p for p in psutil.process_iter(["cmdline"])
                      if "ServeReplica:nanoinfer:engine-0" in " ".join(p.info["cmdline"] or []))

        async def load_and_kill():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

            streaming = asyncio.Semaphore(0)  # released once per stream that has its first chunk

            async def long(i: int):
                try:
                    stream = await client.completions.create(model="m", prompt=texts[i], max_tokens=200, temperature=0,
                                                             stream=True, extra_body={"ignore_eos": True})
                    n = 0
                    async for _ in stream:
                        n += 1
                        if n == 1:
                            streaming.release()
                    return n
                except openai.APIError as e:
                    streaming.release()
                    return e

            tasks = [asyncio.create_task(long(i)) for i in range(8)]
            for _ in range(8):  # every stream under way (a fast CPU ran 200 tokens out before a fixed sleep ended)
                await asyncio.wait_for(streaming.acquire(), 60)
            os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            after = await asyncio.gather(*(client.completions.create(model="m", prompt=t, max_tokens=8, temperature=0)
                                           for t in texts[:8]))
            await client.close()
            return results, after

        results, after = asyncio.run(load_and_kill())
        failed = [r for r in results if isinstance(r, Exception)]
        assert failed and len(failed) < len(results), results  # some were on the victim, some on the survivor
        assert all(isinstance(r, openai.APIError) for r in failed)
        assert all(len(a.choices) == 1 and a.choices[0].finish_reason == "length" for a in after)


def test_prefix_routing_keeps_a_prompt_on_its_replica():
    """Each system prompt's conversations go where the first went; new prompts spread over the
    least busy replicas; a replica far busier than the rest is skipped; round-robin ignores prefixes."""
    systems = [f"You are assistant number {k}. " * 12 for k in range(8)]
    state = RouterState(2)
    first: dict[int, int] = {}
    for conv in range(32):
        for k, s in enumerate(systems):
            body = {"messages": [{"role": "system", "content": s}, {"role": "user", "content": f"question {conv}"}]}
            text = routing_text(ROUTES, "POST", "/v1/chat/completions", json.dumps(body).encode())
            pick = state.choose(text)
            first.setdefault(k, pick)
            assert pick == first[k]
    assert sorted(first.values()).count(0) == 4  # spread evenly
    state.in_flight[first[0]] = BUSY_SLACK + 1  # its replica is now much busier: the other takes it
    more = json.dumps({"prompt": systems[0] + " more"}).encode()
    assert state.choose(routing_text(ROUTES, "POST", "/v1/completions", more)) != first[0]
    rr = RouterState(2, policy="round-robin")
    assert [rr.choose(systems[0]) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_table_and_metrics_labels():
    table = PrefixTable(capacity=4)
    a, b = PrefixTable.chain("x" * 200), PrefixTable.chain("x" * 130 + "y" * 70)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    table.record(a, 1)
    assert table.longest(b, {0, 1}) == (1, 2)
    assert table.longest(b, {0}) == (None, 0)
    table.record(PrefixTable.chain("z" * 192), 0)  # capacity 4: the oldest entries go
    assert len(table.owners) == 4
    lines = labelled('# HELP a_total A\n# TYPE a_total counter\na_total 3.0\nb{k="v"} 1.0\n', 1, set())
    assert lines == ["# HELP a_total A", "# TYPE a_total counter", 'a_total{replica="1"} 3.0', 'b{replica="1",k="v"} 1.0']
