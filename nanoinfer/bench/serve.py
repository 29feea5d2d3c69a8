"""`bench serve`: load on any OpenAI-compatible server (ours, vLLM, llama.cpp's server), measured
from the client, with the figures of vLLM's benchmark_serving.

Requests: N prompts of random words, input and output lengths uniform in
[L * (1 - range_ratio), L * (1 + range_ratio)] (vLLM's random dataset). The bench has no
tokenizer of its own (the server may be anyone's), so prompts are sized with the server's
/tokenize when it has one (ours and vLLM's do) and by a words-per-token guess otherwise.

Arrivals: Poisson at --request-rate (exponential gaps, seeded; inf = all at once), at most
--concurrency in flight; both combine. Every request streams (SSE, include_usage) and is timed
here: TTFT to the first chunk with content, ITL between content chunks, TPOT = (E2E - TTFT) /
(output tokens - 1), E2E to the end of the stream. Output tokens come from the usage chunk when
the server sends one, else one per content chunk. A failed request is counted by error kind,
never raised. The run is bounded: N requests, a per-request timeout and one for the whole run.

Goodput (vLLM's): completed requests per second that meet every SLO given with --goodput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import NanoinferError
from .common import emit_json, median, percentile, plot_path, print_table, progress, progress_done

# Short, frequent English words: about one token each (with their leading space) in the
# usual BPE vocabularies, so the no-/tokenize guess of one token per word is close.
WORDS = [
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "his",
    "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some", "we", "can",
    "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she", "which",
    "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so",
    "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go",
    "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first",
    "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place",
    "made", "live", "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every",
    "good", "me", "give", "our", "under", "name", "very", "through", "just", "form", "great", "think", "say", "help",
    "low", "line", "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old", "too", "same", "tell",
    "does", "set", "three", "want", "air", "well", "also", "play", "small", "end", "put", "home", "read", "hand",
    "port", "large", "spell", "add", "even", "land", "here", "must", "big", "high"
]

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


# --- requests ------------------------------------------------------------------------------
@dataclass
class RequestSpec:
    prompt: str
    input_len: int  # asked-for prompt tokens
    output_len: int  # max_tokens
    prompt_tokens: int | None = None  # measured with the server's /tokenize, when it has one


@dataclass
class RequestResult:
    ok: bool
    error_kind: str | None = None
    error: str | None = None
    ttft: float | None = None  # seconds; None when no content came
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    prompt_tokens_from: str = "estimate"  # usage | tokenize | estimate

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def failure(kind: str, message: str, started: float | None = None) -> RequestResult:
    return RequestResult(False, kind, message[:300], e2el=time.perf_counter() - started if started else 0.0)


def uniform_lens(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def prompt_words(seed: int, index: int, count: int) -> str:
    # One seeded stream per prompt: a prompt's first k words do not depend on k, so sizing
    # it never reshuffles it, and no two prompts share a prefix (no prefix-cache hits).
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def arrival_offsets(rng: random.Random, n: int, rate: float) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process (exponential
    gaps of mean 1/rate), the first at 0; rate inf sends all at once."""
    offsets, t = [], 0.0
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


# --- talking to the server ---------------------------------------------------------------
@dataclass
class Target:
    url: str  # base, without /v1
    endpoint: str  # chat | completions
    model: str | None
    ignore_eos: bool

    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self, spec: RequestSpec) -> dict:
        # Greedy, as vLLM's bench: the same prompts give the same work on every run.
        body: dict[str, Any] = {"max_tokens": spec.output_len, "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # not OpenAI's, but vLLM's and ours: fixed output lengths
        return body


def chunk_text(obj: dict) -> str:
    """The generated text in one streamed chunk (completions: text; chat: delta content, or a
    reasoning model's reasoning_content, which is output too)."""
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def error_kind(e: BaseException, httpx) -> str:
    if isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect_error"
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "connection_lost"
    if isinstance(e, json.JSONDecodeError):
        return "bad_response"
    return type(e).__name__


async def stream_request(client, target: Target, spec: RequestSpec) -> RequestResult:
    t0 = time.perf_counter()
    ttft, last, itl, chunks, usage = None, t0, [], 0, None
    async with client.stream("POST", target.url + target.path(), json=target.body(spec)) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            return failure(f"http_{r.status_code}", str(text), t0)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):  # an error after the 200: ours and vLLM's send one as an event
                err = obj["error"]
                return failure("stream_error", str(err.get("message", err) if isinstance(err, dict) else err), t0)
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            if chunk_text(obj):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    res = RequestResult(True, ttft=ttft, itl=itl, e2el=time.perf_counter() - t0, output_tokens=chunks)
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens, res.prompt_tokens_from = int(usage["prompt_tokens"]), "usage"
    if res.prompt_tokens is None:
        res.prompt_tokens = spec.prompt_tokens if spec.prompt_tokens is not None else spec.input_len
        res.prompt_tokens_from = "tokenize" if spec.prompt_tokens is not None else "estimate"
    return res


async def send(client, httpx, target: Target, spec: RequestSpec, timeout: float | None) -> RequestResult:
    """One request, never raising (but for cancellation, which ends the run)."""
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(stream_request(client, target, spec), timeout)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 -- every failure is a figure of the bench
        return failure(error_kind(e, httpx), f"{type(e).__name__}: {e}", t0)


async def first_model(client, url: str, timeout: float) -> tuple[str | None, list]:
    r = await client.get(url + "/v1/models", timeout=timeout)
    r.raise_for_status()
    data = r.json().get("data") or []
    return (data[0].get("id") if data else None), data


async def count_tokens(client, url: str, model: str | None, text: str) -> int | None:
    """Tokens of `text` by the server's /tokenize (ours and vLLM's: prompt -> count;
    llama.cpp's: content -> tokens), without BOS; None when there is no such endpoint."""
    body: dict[str, Any] = {"prompt": text, "content": text, "add_special_tokens": False}
    if model is not None:
        body["model"] = model
    try:
        r = await client.post(url + "/tokenize", json=body)
        if r.status_code != 200:
            return None
        obj = r.json()
        return int(obj["count"]) if "count" in obj else len(obj["tokens"])
    except Exception:  # noqa: BLE001 -- no usable /tokenize: the caller guesses instead
        return None


async def fit_prompt(client, url: str, model: str | None, seed: int, index: int, target: int,
                     tokens_per_word: float) -> tuple[str, int | None]:
    """The prompt of `target` tokens (or the closest found in a few tries) and its count."""
    k = max(1, round(target / tokens_per_word))
    best: tuple[int, str, int] | None = None
    for _ in range(5):
        text = prompt_words(seed, index, k)
        n = await count_tokens(client, url, model, text)
        if n is None:
            return text, None
        if best is None or abs(n - target) < best[0]:
            best = (abs(n - target), text, n)
        if n == target:
            break
        k = max(1, k + (round((target - n) / tokens_per_word) or (1 if n < target else -1)))
    return best[1], best[2]


def guessed_specs(input_lens: list[int], output_lens: list[int], seed: int) -> list[RequestSpec]:
    """Without /tokenize: one token per word (see WORDS)."""
    return [RequestSpec(prompt_words(seed, i, L), L, o) for i, (L, o) in enumerate(zip(input_lens, output_lens))]


async def build_specs(client, url: str, model: str | None, input_lens: list[int], output_lens: list[int],
                      seed: int) -> tuple[list[RequestSpec], str]:
    """Prompts sized with /tokenize when the server has one; else one token per word."""
    sample = prompt_words(seed, -1, 400)
    n = await count_tokens(client, url, model, sample)
    if n is None:
        return guessed_specs(input_lens, output_lens, seed), "estimate"
    per_word = max(n / 400, 0.05)
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> RequestSpec:
        async with sem:
            text, count = await fit_prompt(client, url, model, seed, i, input_lens[i], per_word)
        return RequestSpec(text, input_lens[i], output_lens[i], count)

    return list(await asyncio.gather(*(one(i) for i in range(len(input_lens))))), "tokenize"


# --- the run -------------------------------------------------------------------------------
@dataclass
class LoadResult:
    results: list[RequestResult]
    duration: float
    max_in_flight: int
    run_timed_out: bool


async def drive(client, httpx, target: Target, specs: list[RequestSpec], offsets: list[float],
                concurrency: int | None, request_timeout: float | None, run_timeout: float) -> LoadResult:
    n = len(specs)
    results: list[RequestResult | None] = [None] * n
    sent = [False] * n
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    state = {"in_flight": 0, "max": 0, "done": 0, "failed": 0}

    def show() -> None:
        done = state["done"]
        bar = "#" * (30 * done // n)
        progress(f"serve: [{bar:<30}] {done}/{n} done, {state['failed']} failed, {state['in_flight']} in flight",
                 throttle=done < n)

    async def one(i: int) -> None:
        if sem is not None:
            await sem.acquire()
        try:
            sent[i] = True
            state["in_flight"] += 1
            state["max"] = max(state["max"], state["in_flight"])
            results[i] = res = await send(client, httpx, target, specs[i], request_timeout)
            state["in_flight"] -= 1
            state["done"] += 1
            state["failed"] += not res.ok
            show()
        finally:
            if sem is not None:
                sem.release()

    async def dispatch() -> None:
        tasks = []
        for i in range(n):
            wait = start + offsets[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)  # cancelled at the run's deadline: cancels every request

    start = time.perf_counter()
    timed_out = False
    try:
        await asyncio.wait_for(dispatch(), run_timeout)
    except TimeoutError:
        timed_out = True
    duration = time.perf_counter() - start
    progress_done()
    final = [r if r is not None else
             failure("run_timeout", "still running when the run's --timeout ran out") if sent[i] else
             failure("not_sent", "not sent before the run's --timeout ran out")
             for i, r in enumerate(results)]
    return LoadResult(final, duration, state["max"], timed_out)


# --- figures -------------------------------------------------------------------------------
def stats_ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": 1e3 * sum(xs) / len(xs), "median": 1e3 * median(xs), "p99": 1e3 * percentile(xs, 99)}


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    # A request with no content has no TTFT of its own: its first token was the end, at E2E.
    # A one-token reply has no TPOT, so it meets a TPOT SLO (as in vLLM).
    values = {"ttft": r.ttft if r.ttft is not None else r.e2el, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(1e3 * values[k] <= v for k, v in slos.items())


def summarize(load: LoadResult, slos: dict[str, float]) -> dict:
    ok = [r for r in load.results if r.ok]
    bad = [r for r in load.results if not r.ok]
    d = max(load.duration, 1e-9)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(bad),
        "errors": dict(Counter(r.error_kind for r in bad)),
        "error_examples": {r.error_kind: r.error for r in reversed(bad)},  # the first of each kind
        "duration_s": load.duration, "run_timed_out": load.run_timed_out, "max_in_flight": load.max_in_flight,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "input_tokens_from": dict(Counter(r.prompt_tokens_from for r in ok)),
        "request_throughput": len(ok) / d, "output_throughput": output_tokens / d,
        "total_token_throughput": (input_tokens + output_tokens) / d,
        "request_goodput": sum(meets_slos(r, slos) for r in ok) / d if slos else None,
    }
    for name in LATENCY_METRICS:
        for stat, value in stats_ms(series[name]).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_report(s: dict, slos: dict[str, float]) -> None:
    rows = [["successful requests", str(s["completed"])], ["failed requests", str(s["failed"])],
            ["duration (s)", fmt(s["duration_s"])], ["total input tokens", str(s["total_input_tokens"])],
            ["total output tokens", str(s["total_output_tokens"])],
            ["request throughput (req/s)", fmt(s["request_throughput"])],
            ["output token throughput (tok/s)", fmt(s["output_throughput"])],
            ["total token throughput (tok/s)", fmt(s["total_token_throughput"])]]
    if slos:
        rows.append([f"goodput (req/s; {' '.join(f'{k}<={v:g}ms' for k, v in slos.items())})",
                     fmt(s["request_goodput"])])
    if s["errors"]:
        rows.append(["errors", ", ".join(f"{k} x{v}" for k, v in s["errors"].items())])
    print_table(["", "value"], rows)
    print()
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
    print_table(["latency (ms)", "mean", "median", "p99"],
                [[names[m], *(fmt(s[f"{st}_{m}_ms"]) for st in ("mean", "median", "p99"))] for m in LATENCY_METRICS])
    for kind, message in s["error_examples"].items():
        print(f"{kind}: {message}")


def draw(path: str, results: list[RequestResult], title: str) -> None:
    """CDFs of TTFT and E2E per request, and the ITL histogram: tails show at a glance."""
    from .plots import plt

    ok = [r for r in results if r.ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for xs, label in (([r.ttft for r in ok if r.ttft is not None], "TTFT"), ([r.e2el for r in ok], "E2E latency")):
        xs = sorted(1e3 * x for x in xs)
        if xs:
            left.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    left.set_xlabel("ms")
    left.set_ylabel("fraction of requests")
    left.set_title("per-request latency (CDF)", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend()
    itl = [1e3 * g for r in ok for g in r.itl]
    if itl:
        right.hist(itl, bins=min(60, max(10, len(itl) // 20)), color="tab:green")
    right.set_xlabel("inter-token latency (ms)")
    right.set_ylabel("chunks")
    right.set_title("ITL (histogram)", fontsize=10)
    right.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------
def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_METRICS:
            raise NanoinferError(f"--goodput {item!r}: give METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise NanoinferError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or not math.isfinite(ms):
            raise NanoinferError(f"--goodput {item!r}: milliseconds must be >= 0")
        slos[key] = ms
    return slos


def check_args(a: argparse.Namespace) -> None:
    if not a.url.startswith(("http://", "https://")):
        raise NanoinferError(f"--url {a.url!r}: give a base URL such as http://127.0.0.1:8000")
    for flag in ("num_requests", "input_len", "output_len"):
        if getattr(a, flag) < 1:
            raise NanoinferError(f"--{flag.replace('_', '-')} must be >= 1")
    if a.concurrency is not None and a.concurrency < 1:
        raise NanoinferError("--concurrency must be >= 1")
    if a.request_rate is not None and not a.request_rate > 0:
        raise NanoinferError("--request-rate must be > 0 (or inf)")
    if not 0 <= a.range_ratio < 1:
        raise NanoinferError("--range-ratio must be in [0, 1)")
    for flag in ("timeout", "request_timeout"):
        value = getattr(a, flag)
        if value is not None and not value > 0:
            raise NanoinferError(f"--{flag.replace('_', '-')} must be > 0")
    if a.warmup < 0:
        raise NanoinferError("--warmup must be >= 0")


async def prefix_cache_counts(client, url: str, timeout: float) -> dict[str, float] | None:
    """nanoinfer's prefix-cache counters from /metrics, summed over every label set (replicas);
    None for a server without them."""
    try:
        text = (await client.get(f"{url}/metrics", timeout=max(timeout, 0.1))).text
    except Exception:  # noqa: BLE001 -- not every server has /metrics
        return None
    out = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key in out:
            if line.startswith(f"nanoinfer_prefix_cache_{key}_total"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out if out["queries"] else None


def base_url(url: str) -> str:
    # People paste the OpenAI client's base URL, which ends in /v1.
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def bench(a: argparse.Namespace, slos: dict[str, float]) -> tuple[dict, LoadResult, Target]:
    import httpx2 as httpx

    url = base_url(a.url)
    rate = a.request_rate if a.request_rate is not None else math.inf
    cap = a.concurrency or a.num_requests
    # A pool as large as the most requests in flight: none waits for a connection, which
    # would count the client's queue as the server's latency. trust_env=False: no proxy.
    limits = httpx.Limits(max_connections=cap + 16, max_keepalive_connections=cap + 16)
    timeout = httpx.Timeout(a.request_timeout or a.timeout, connect=min(10.0, a.request_timeout or a.timeout))
    deadline = time.perf_counter() + a.timeout  # set-up included: the run stops by itself

    def left() -> float:
        return max(0.0, deadline - time.perf_counter())

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model, models = a.model, []
        try:
            # Any server answers this at once: a small share of the run's time is enough.
            found, models = await first_model(client, url, min(5.0, left() / 4))
            model = model or found
        except Exception as e:  # noqa: BLE001 -- the requests will fail and be counted
            progress(f"warning: GET {url}/v1/models failed ({type(e).__name__}: {e}); "
                     f"{'using --model' if model else 'sending no model name'}")
        rng = random.Random(a.seed)
        input_lens = uniform_lens(rng, a.num_requests, a.input_len, a.range_ratio)
        output_lens = uniform_lens(rng, a.num_requests, a.output_len, a.range_ratio)
        offsets = arrival_offsets(rng, a.num_requests, rate)
        progress(f"building {a.num_requests} prompts ...")
        try:
            specs, sized_by = await asyncio.wait_for(
                build_specs(client, url, model, input_lens, output_lens, a.seed), left())
        except TimeoutError:
            specs, sized_by = guessed_specs(input_lens, output_lens, a.seed), "estimate"
        progress_done()
        if a.shared_prefixes:  # K system prompts, each starting an equal share of the requests, in a seeded order
            systems = [prompt_words(a.seed + 7919, k, a.prefix_len) for k in range(a.shared_prefixes)]
            which = [i % len(systems) for i in range(len(specs))]
            random.Random(a.seed + 1).shuffle(which)
            specs = [replace(sp, prompt=f"{systems[k]}\n{sp.prompt}", prompt_tokens=None,
                             input_len=sp.input_len + a.prefix_len) for k, sp in zip(which, specs)]
        target = Target(url, a.endpoint, model, a.ignore_eos)
        for k in range(a.warmup):  # the server's first requests may pay for lazy set-up: not timed
            progress(f"warm-up request {k + 1}/{a.warmup} ...")
            w = await send(client, httpx, target, specs[k % len(specs)], min(left(), a.request_timeout or 60.0))
            if not w.ok:
                progress(f"warning: warm-up request failed: {w.error_kind}: {w.error}")
        progress_done()
        cache_before = await prefix_cache_counts(client, url, min(10.0, left())) if a.shared_prefixes else None
        load = await drive(client, httpx, target, specs, offsets, a.concurrency, a.request_timeout, left())
        cache_after = await prefix_cache_counts(client, url, min(10.0, left())) if cache_before else None
    summary = summarize(load, slos)
    if cache_before and cache_after:  # the server's own count, over all its replicas
        hits, queries = (cache_after[k] - cache_before[k] for k in ("hits", "queries"))
        summary["prefix_cache_hit_rate"] = hits / queries if queries else None
    summary["prompts_sized_by"] = sized_by
    summary["server_models"] = models
    return summary, load, target


def run(a: argparse.Namespace) -> int:
    try:
        import httpx2
    except ImportError:
        raise NanoinferError("bench serve needs the httpx2 package (pip install httpx2)") from None
    check_args(a)
    slos = parse_goodput(a.goodput)
    plot = plot_path(a)
    summary, load, target = asyncio.run(bench(a, slos))

    import torch

    from .common import machine, versions

    mode = (f"rate {a.request_rate:g}/s" if a.request_rate is not None else "all at once") + \
        (f", concurrency {a.concurrency}" if a.concurrency else "")
    print(f"serve: {target.url} {target.path()} model {target.model or '?'}, {a.num_requests} requests, {mode}, "
          f"input {a.input_len} / output {a.output_len} tokens (range ratio {a.range_ratio:g})")
    print_report(summary, slos)
    if summary.get("prefix_cache_hit_rate") is not None:
        print(f"prefix cache: {summary['prefix_cache_hit_rate']:.1%} of prompt tokens found cached (the server's count)")
    if plot:
        draw(plot, load.results, f"{target.model} at {target.url}: {a.num_requests} requests, {mode}")
        print(f"plot: {plot}")
    config = {k: getattr(a, k) for k in ("endpoint", "num_requests", "request_rate", "concurrency", "input_len",
                                         "output_len", "range_ratio", "ignore_eos", "seed", "timeout",
                                         "request_timeout", "warmup", "shared_prefixes", "prefix_len")}
    config["goodput_slos_ms"] = slos
    emit_json({"bench": "serve", "url": target.url, "endpoint_path": target.path(), "model": target.model,
               "config": config, **summary,
               "versions": {**versions(), "httpx2": httpx2.__version__},
               "machine": machine(torch.device("cpu"))})  # the client's machine: the server's is its own
    return 0 if summary["completed"] else 1
