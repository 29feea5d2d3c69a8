"""The HTTP server in a real process on loopback, driven by the official openai client.

One server per module (the tiny random Llama from conftest), plus a scripted-model server for
tool calls. Generations are short: the suite must stay fast on 2 shared cores.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoinfer import LLM, SamplingParams

from server_utils import run_server, scripted_server_command, start_server

MAX_N, MAX_TOKENS, MAX_BYTES = 4, 200, 65536
SERVER_ARGS = ["--max-n", str(MAX_N), "--max-tokens-limit", str(MAX_TOKENS), "--max-request-bytes", str(MAX_BYTES),
               "--kv-cache-memory", "64M", "--max-num-seqs", "64", "--log-level", "warning"]
CHAT = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def model_path(make_hf_model):
    return make_hf_model("llama")[1]


@pytest.fixture(scope="module")
def server(model_path):
    with run_server(["--model", str(model_path), *SERVER_ARGS]) as url:
        yield url


LONG_REPLY = 60000  # tokens: a minute or more of generation


@pytest.fixture(scope="module")
def long_reply_server(long_reply_model):
    """A server whose replies run for a minute unless the client goes away, so the
    disconnect tests do not race the engine however fast it gets."""
    args = ["--model", str(long_reply_model), "--max-n", str(MAX_N), "--max-tokens-limit", str(LONG_REPLY),
            "--kv-cache-memory", "160M", "--log-level", "warning"]
    with run_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name or name{label=value}: value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no sequence runs or waits and no KV block is held (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["nanoinfer_kv_cache_blocks_used"] == 0 and m["nanoinfer_num_requests_running"] == 0
                and m["nanoinfer_num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# --- basics -----------------------------------------------------------------------------

def test_models_health_and_page(server, model, model_path):
    assert model == model_path.name
    r = httpx.get(f"{server}/v1/models")
    assert r.json()["data"][0]["max_model_len"] == 256
    r = httpx.get(f"{server}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(f"{server}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text
    r = httpx.get(f"{server}/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_chat_greedy_equals_offline(client, model, offline):
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
    ref = offline.chat(CHAT, greedy(12))[0]
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert c.message.role == "assistant" and c.message.content == ref.outputs[0].text
    assert c.finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(offline.chat_ids(CHAT))
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_prompt_forms_equal_offline(client, model, offline):
    prompts = ["The quick brown fox", "def add(a, b):"]
    refs = offline.generate(prompts, greedy(8, ignore_eos=True))
    r = client.completions.create(model=model, prompt=prompts[0], temperature=0, max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == refs[0].outputs[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    ids = offline.tokenizer.encode(prompts[0])
    r = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].text == refs[0].outputs[0].text and r.usage.prompt_tokens == len(ids)
    # Several prompts, n each: choice index = prompt * n + sample.
    r = client.completions.create(model=model, prompt=prompts, temperature=0, max_tokens=8, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0].outputs[0].text] * 2 + [refs[1].outputs[0].text] * 2
    assert r.usage.completion_tokens == 32
    r = client.completions.create(model=model, prompt=[ids, offline.tokenizer.encode(prompts[1])], temperature=0,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]


def test_echo(client, model):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith("Hello")
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # prompt tokens carry none
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_stream_equals_non_stream_with_usage(client, model):
    kw = dict(model=model, messages=CHAT, temperature=0, max_tokens=10)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_raw_sse(server, model):
    body = {"model": model, "prompt": "Numbers: 0 1 2", "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=30).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_n_samples_stream_per_choice(client, model):
    kw = dict(model=model, messages=CHAT, max_tokens=6, n=3, seed=11, temperature=1.0)
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = dict.fromkeys(range(3), "")
    finished = set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]  # seeded: same samples
    assert len(set(texts.values())) > 1  # and they differ from each other


def test_seed_reproducible_at_temperature_1(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=4321).choices[0].text
    assert a == b and a != c


def test_stop_string(client, model):
    kw = dict(model=model, prompt="Hello, world!", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[6:8]
    r = client.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_logprobs_shapes(client, model):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Up to 3 + the sampled token; tokens with the same text (partial characters) share one key.
        assert val <= 0 and 1 <= len(top) <= 4 and top[tok] == val  # greedy: the sampled token is the top one
        assert max(top.values()) == val
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token
    streamed = [e for c in client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


def test_tokenize_detokenize(server, model, offline):
    r = httpx.post(f"{server}/tokenize", json={"prompt": "Hello, world!"}).json()
    assert r["tokens"] == offline.tokenizer.encode("Hello, world!") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    r2 = httpx.post(f"{server}/tokenize", json={"model": model, "messages": CHAT}).json()
    assert r2["tokens"] == offline.chat_ids(CHAT)
    d = httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello, world!"
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics(server, client, model):
    before = metrics(server)
    client.completions.create(model=model, prompt="Hi", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    m = wait_idle(server)
    for name in ["nanoinfer_num_requests_running", "nanoinfer_num_requests_waiting", "nanoinfer_kv_cache_blocks_used",
                 "nanoinfer_kv_cache_usage_ratio", "nanoinfer_prefix_cache_hit_rate",
                 "nanoinfer_num_preemptions_total", "nanoinfer_time_to_first_token_seconds_count",
                 "nanoinfer_inter_token_latency_seconds_bucket{le=+Inf}", "nanoinfer_e2e_request_latency_seconds_sum"]:
        assert name in m, name
    assert m["nanoinfer_kv_cache_blocks_total"] > 0
    assert m["nanoinfer_generation_tokens_total"] - before["nanoinfer_generation_tokens_total"] == 5
    assert m["nanoinfer_prompt_tokens_total"] > before["nanoinfer_prompt_tokens_total"]
    key = "nanoinfer_request_success_total{finish_reason=length}"
    assert m[key] == before[key] + 1
    assert m["nanoinfer_inter_token_latency_seconds_count"] - before["nanoinfer_inter_token_latency_seconds_count"] == 4


# --- load and disconnects ----------------------------------------------------------------

def test_32_concurrent_streams_while_health_answers(server, model, offline):
    prompts = [f"Request number {i}: tell me about {w}" for i, w in
               zip(range(32), ["cats", "dogs", "rust", "tea"] * 8)]
    ref = {p: o.outputs[0].text for p, o in zip(prompts, offline.generate(prompts, greedy(8, ignore_eos=True)))}
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(f"{server}/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def load() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))
        finally:
            await aclient.close()

    t = threading.Thread(target=probe)
    t.start()
    try:
        outs = asyncio.run(load())
    finally:
        stop.set()
        t.join()
    assert outs == [ref[p] for p in prompts]
    assert latencies and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f}s under load"
    assert wait_idle(server)["nanoinfer_kv_cache_blocks_used"] == 0


def test_streaming_disconnect_frees_kv_blocks(long_reply_server):
    server = long_reply_server
    before = metrics(server)["nanoinfer_request_success_total{finish_reason=abort}"]
    body = {"prompt": "Tell me a long story", "max_tokens": LONG_REPLY, "temperature": 0, "stream": True,
            "ignore_eos": True}
    clients = [httpx.Client(timeout=30) for _ in range(4)]
    streams = []
    for c in clients:  # four at once, each closed after a few chunks
        cm = c.stream("POST", f"{server}/v1/completions", json=body)
        r = cm.__enter__()
        lines = r.iter_lines()
        got = [next(lines) for _ in range(5)]
        assert any(line.startswith("data: {") for line in got)
        streams.append(cm)
    assert metrics(server)["nanoinfer_kv_cache_blocks_used"] > 0
    for cm, c in zip(streams, clients):
        cm.__exit__(None, None, None)
        c.close()
    m = wait_idle(server)
    assert m["nanoinfer_kv_cache_blocks_used"] == 0 and m["nanoinfer_num_requests_running"] == 0
    assert m["nanoinfer_request_success_total{finish_reason=abort}"] == before + 4


def test_non_streaming_disconnect_aborts(long_reply_server):
    server = long_reply_server
    before = metrics(server)["nanoinfer_request_success_total{finish_reason=abort}"]
    body = {"prompt": "Tell me a long story", "max_tokens": LONG_REPLY, "temperature": 0, "ignore_eos": True,
            "n": MAX_N}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.15))
    m = wait_idle(server)
    assert m["nanoinfer_kv_cache_blocks_used"] == 0
    assert m["nanoinfer_request_success_total{finish_reason=abort}"] == before + MAX_N


# --- bad input ---------------------------------------------------------------------------

LONG = "word " * 400  # far over the 256-token context
BAD = [
    # (endpoint, body (dict, or raw bytes), status, param)
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": CHAT, "top_p": 2}, 400, "top_p"),
    ("chat", {"messages": CHAT, "n": 0}, 400, "n"),
    ("chat", {"messages": CHAT, "n": MAX_N + 1}, 400, "n"),
    ("chat", {"messages": CHAT, "n": 1.5}, 400, "n"),
    ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens"),
    ("chat", {"messages": CHAT, "max_completion_tokens": MAX_TOKENS + 1}, 400, "max_completion_tokens"),
    ("chat", {"messages": CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("chat", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("chat", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     400, "response_format.json_schema.schema"),
    ("chat", {"messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("chat", {"messages": CHAT, "guided_json": {"type": "object"}, "guided_regex": "a"}, 400, "guided_regex"),
    ("completions", {"prompt": "hi", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("completions", {"prompt": "hi", "guided_grammar": "start: nope"}, 400, "guided_grammar"),
    ("completions", {"prompt": "hi", "structured_outputs": {"json": "{bad"}}, 400, "structured_outputs.json"),
    ("chat", {"messages": CHAT, "model": "gpt-17"}, 404, "model"),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x" * (MAX_BYTES + 10)}]}, 413, None),
    ("completions", {"prompt": LONG}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": [10 ** 6]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    ("completions", {}, 400, "prompt"),
    ("tokenize", {}, 400, "prompt"),
    ("detokenize", {"tokens": "abc"}, 400, "tokens"),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_request(server, endpoint, body, status, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{PATHS[endpoint]}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if status == 400:  # OpenAI's kinds of error code
        assert err["code"] in ("invalid_json", "invalid_type", "invalid_value", "missing_required_parameter",
                               "context_length_exceeded", "invalid_constraint", "constraint_too_large"), err
    assert err["param"] == param, err


def test_still_serving_after_bad_requests(client, model, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, temperature=5000)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


# --- tool calls (a scripted model) ----------------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCRIPTS = {
    "HELLO?": "Hello! No tools needed.",
    "WEATHER?": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "BOTH?": 'Checking both.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>',
    "LLAMA?": '{"name": "get_time", "parameters": {"tz": "UTC"}}',
    "RESULT:": "It is sunny in Paris.",
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def tool_client(tiny_tokenizer_dir, tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("tool_template")
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    with run_server([], command=scripted_server_command(folder, SCRIPTS)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_tool_call_non_streaming(tool_client):
    r = tool_client.chat.completions.create(model="scripted", messages=ask("WEATHER?"), tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    r = tool_client.chat.completions.create(model="scripted", messages=ask("BOTH?"), tools=TOOLS)
    c = r.choices[0]
    assert c.message.content == "Checking both." and c.finish_reason == "tool_calls"
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather", "get_time"]

    r = tool_client.chat.completions.create(model="scripted", messages=ask("LLAMA?"), tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}

    r = tool_client.chat.completions.create(model="scripted", messages=ask("HELLO?"), tools=TOOLS)
    assert r.choices[0].message.content == SCRIPTS["HELLO?"] and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_call_streaming(tool_client):
    calls, content, finish = {}, "", None
    for chunk in tool_client.chat.completions.create(model="scripted", messages=ask("BOTH?"), tools=TOOLS,
                                                     stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        assert "<tool" not in (d.content or "")  # held back, never shown as text
        for t in d.tool_calls or []:
            calls[t.index] = (t.id, t.function.name, json.loads(t.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking both." and finish == "tool_calls"
    assert [c[1:] for c in calls.values()] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c[0].startswith("call_") for c in calls.values())


def test_tool_result_turn_and_tool_choice_none(tool_client):
    first = tool_client.chat.completions.create(model="scripted", messages=ask("WEATHER?"), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages = ask("WEATHER?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "RESULT: sunny, 21C"},
    ]
    r = tool_client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    # The tool call was rendered back into the prompt with its arguments as an object.
    prompt = httpx.post(str(tool_client.base_url).replace("/v1/", "/tokenize"),
                        json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    assert len(prompt) > 0
    r = tool_client.chat.completions.create(model="scripted", messages=ask("WEATHER?"), tools=TOOLS,
                                            tool_choice="none")
    assert r.choices[0].message.content == SCRIPTS["WEATHER?"] and r.choices[0].finish_reason == "stop"


# --- graceful shutdown -------------------------------------------------------------------

def test_sigterm_lets_in_flight_stream_finish(model_path):
    server = start_server(["--model", str(model_path), "--kv-cache-memory", "16M", "--log-level", "warning",
                           "--shutdown-timeout", "120"])  # ample: finishing must not depend on load
    try:
        body = {"prompt": "Tell me a story", "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        chunks = [json.loads(x[6:]) for x in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)
    finally:
        server.stop(signal.SIGKILL)


# --- the tool-call parser alone --------------------------------------------------------------

PARSE_CASES = [
    ("plain text", "plain text", []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
    ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "g", '
     '"arguments": "{\\"x\\": 2}"}</tool_call>\n', "Let me look.", [("f", {}), ("g", {"x": 2})]),
    ('{"name": "f", "parameters": {"q": "x"}}', None, [("f", {"q": "x"})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', None, [("a", {}), ("b", {})]),
    ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # EOS before the closing tag
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("a < b and <tool", "a < b and <tool", []),
]


@pytest.mark.parametrize("text,content,calls", PARSE_CASES)
def test_tool_call_parser(text, content, calls):
    from nanoinfer.server.tool_calls import ToolCallParser, parse_tool_calls

    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    # Streamed one character at a time: the same calls, and no marker ever shown as text.
    parser = ToolCallParser()
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    streamed = "".join(v for kind, v in events if kind == "content")
    assert [(v.name, json.loads(v.arguments)) for kind, v in events if kind == "call"] == calls
    if calls:
        assert streamed.strip() == (content or "") and "<tool_call>" not in streamed
    else:
        assert streamed == text
