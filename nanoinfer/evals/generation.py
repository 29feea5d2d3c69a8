"""n completions per prompt for an evaluation, from nanoinfer's engine or from any
OpenAI-compatible server (ours, llama.cpp's, vLLM's): the same requests either way, so a
greedy run gives the same text through both when the server runs the same model."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import NanoinferError
from ..sampling import SamplingParams


@dataclass
class Request:
    prompt: str | None = None  # raw completion
    messages: list[dict] | None = None  # chat


@dataclass
class Generation:
    texts: list[list[str]]  # per request, its n completions in order
    completion_tokens: int
    prompt_tokens: int
    seconds: float
    prefill_tokens: int | None = None  # prompt tokens the engine ran (local only): n samples share one prefill


def generate_local(llm, requests: list[Request], params: SamplingParams, progress: bool = False) -> Generation:
    """All requests into the engine at once (continuous batching; each request's n samples
    are forks of one prefill). progress: the engine's bar of finished requests on stderr."""
    prompts = [r.prompt if r.messages is None else {"prompt_token_ids": llm.chat_ids(r.messages)} for r in requests]
    before = llm.engine.prefill_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    return Generation([[c.text for c in o.outputs] for o in outs],
                      sum(len(c.token_ids) for o in outs for c in o.outputs),
                      sum(len(o.prompt_token_ids) for o in outs), seconds, llm.engine.prefill_tokens - before)


def generate_remote(base_url: str, model: str | None, requests: list[Request], params: SamplingParams,
                    concurrency: int = 8, api_key: str | None = None, timeout_s: float = 600.0,
                    on_progress: Callable[[int], None] | None = None) -> Generation:
    """Each request as one /v1/completions (or /v1/chat/completions) call asking for n choices,
    `concurrency` in flight."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    body = {"n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
    if model:
        body["model"] = model
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = [params.stop] if isinstance(params.stop, str) else list(params.stop)

    def one(r: Request) -> tuple[list[str], int, int]:
        if r.messages is None:
            url, payload = f"{base}/completions", {**body, "prompt": r.prompt}
        else:
            url, payload = f"{base}/chat/completions", {**body, "messages": r.messages}
        reply = _post(url, payload, api_key, timeout_s)
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        texts = [c["text"] if r.messages is None else (c["message"]["content"] or "") for c in choices]
        if len(texts) != params.n:
            raise NanoinferError(f"{url} returned {len(texts)} choices, asked for {params.n}")
        usage = reply.get("usage") or {}
        return texts, usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)

    t0 = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for i, res in enumerate(pool.map(one, requests), 1):
            results.append(res)
            if on_progress is not None:
                on_progress(i)
    return Generation([r[0] for r in results], sum(r[1] for r in results), sum(r[2] for r in results),
                      time.perf_counter() - t0)


def _post(url: str, payload: dict, api_key: str | None, timeout_s: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, json.dumps(payload).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:300]
        raise NanoinferError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise NanoinferError(f"{url}: {getattr(e, 'reason', e)}") from None
