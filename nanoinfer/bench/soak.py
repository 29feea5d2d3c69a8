"""`nanoinfer bench soak`: many mixed requests against a server this command starts, with the
server's resident memory read as they go (issue 25: RSS climbed under mixed load).

The mix, in a seeded random order: completions and chat, streamed and not, n=3, logprobs, JSON
schema and regex constraints, and streams closed by the client mid-prefill. Each request's
prompt is new text (random words), so the prefix cache keeps filling the pool. RSS is read from
/proc/<pid>/status (VmRSS) after every `every` requests.

    nanoinfer bench soak --requests 2000 [--kv-cache-memory 64M] [--concurrency 8]
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx2 as httpx

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
         "xray", "yankee", "zulu", "river", "stone", "cloud", "paper", "light", "engine", "window", "garden",
         "number", "silver", "orange", "planet", "motion", "signal"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@dataclass
class SoakResult:
    rss_kib: list[tuple[int, int]] = field(default_factory=list)  # (requests done, VmRSS)
    statuses: dict[str, int] = field(default_factory=dict)  # "200", "400", "aborted", ... -> count
    seconds: float = 0.0


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _one(client: httpx.Client, kind: str, seed: int) -> str:
    rng = random.Random(seed)
    text = _prompt(rng, rng.randint(20, 120))
    chat = [{"role": "user", "content": text}]
    common = {"max_tokens": rng.randint(4, 24), "temperature": 0.8, "seed": seed}
    if kind == "completion":
        r = client.post("/v1/completions", json={"prompt": text, **common})
    elif kind == "chat":
        r = client.post("/v1/chat/completions", json={"messages": chat, **common})
    elif kind == "n3":
        r = client.post("/v1/chat/completions", json={"messages": chat, "n": 3, **common})
    elif kind == "logprobs":
        r = client.post("/v1/completions", json={"prompt": text, "logprobs": 5, "echo": False, **common})
    elif kind == "json":
        r = client.post("/v1/chat/completions", json={"messages": chat, **common, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
    elif kind == "regex":
        r = client.post("/v1/completions", json={"prompt": text, "guided_regex": "[a-z]{3,8}( [a-z]{3,8}){0,3}",
                                                 **common})
    elif kind in ("stream", "abort"):
        body = {"messages": chat, "stream": True, **common}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                if kind == "abort":  # gone after the first line: mid-prefill for the engine, or just after
                    return "aborted"
        return str(r.status_code)
    else:
        raise ValueError(kind)
    return str(r.status_code)


MIX = {"completion": 20, "chat": 20, "stream": 14, "n3": 8, "logprobs": 8, "json": 8, "regex": 8, "abort": 14}


def soak(url: str, pid: int, requests: int, concurrency: int = 8, every: int = 100, seed: int = 0,
         progress: Callable[[int, int], None] | None = None) -> SoakResult:
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=requests)
    result = SoakResult()
    result.rss_kib.append((0, rss_kib(pid)))
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
        for start in range(0, requests, every):
            batch = kinds[start:start + every]
            for status in pool.map(lambda ks: _one(client, ks[1], seed * 1_000_003 + ks[0]),
                                   enumerate(batch, start)):
                result.statuses[status] = result.statuses.get(status, 0) + 1
            done = start + len(batch)
            result.rss_kib.append((done, rss_kib(pid)))
            if progress is not None:
                progress(done, result.rss_kib[-1][1])
    result.seconds = time.perf_counter() - t0
    return result


def report(result: SoakResult) -> str:
    lines = [f"{done:6d} requests  RSS {kib / 1024:8.1f} MiB" for done, kib in result.rss_kib]
    lines.append(f"statuses: {json.dumps(result.statuses, sort_keys=True)}; {result.seconds:.0f} s")
    return "\n".join(lines)


def start_server(args: list[str], timeout: float = 120.0):
    """`python -m nanoinfer.server ARGS` on a free port: (process, url), once /health answers."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanoinfer.server", *args, "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start: {proc.stderr.read()[-2000:] if proc.stderr else ''}")


def run(a) -> int:
    import signal
    import sys

    args = ["--model", a.model] if a.model else []
    if a.kv_cache_memory:
        args += ["--kv-cache-memory", a.kv_cache_memory]
    proc, url = start_server(args)
    try:
        print(f"[soak: {a.requests} requests, concurrency {a.concurrency}, server pid {proc.pid}]", file=sys.stderr)
        result = soak(url, proc.pid, a.requests, a.concurrency, a.every, a.seed,
                      progress=lambda done, kib: print(f"  {done} requests: RSS {kib / 1024:.1f} MiB", file=sys.stderr))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    print(report(result))
    print(json.dumps({"rss_mib": [[d, round(k / 1024, 1)] for d, k in result.rss_kib], "statuses": result.statuses,
                      "seconds": round(result.seconds, 1)}))
    return 0
