"""Ollama's API (server/routes/ollama.py) with the official `ollama` client against a real server:
chat and generate, streamed (NDJSON) and not, their greedy text equal to the OpenAI routes' for
the same request, `format` as structured output, the model listings (/api/tags, /api/show,
/api/ps, /api/version) and the `name:latest` form, errors in Ollama's `{"error": ...}` shape, and
tool calls both ways (a scripted model writes the call: a small real one rarely does)."""
from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import ollama
import openai
import pytest

import nanoinfer
from nanoinfer.server.outputs import sse
from nanoinfer.server.routes import ollama as routes

from server_utils import run_server, scripted_server_command

GREEDY = {"temperature": 0, "num_predict": 12}
ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def name(client):
    """The served model as /api/tags lists it: with Ollama's :latest tag."""
    (model,) = client.list().models
    return model.model


def test_chat_whole_and_streamed_agree_with_chat_completions(server, client, name):
    whole = client.chat(model=name, messages=ASK, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and 0 < whole.eval_count <= 12
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0 and whole.load_duration == 0
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason and parts[-1].prompt_eval_count == whole.prompt_eval_count
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model=name.removesuffix(":latest"), messages=ASK, max_tokens=12, temperature=0)
    assert whole.message.content == chat.choices[0].message.content
    assert whole.prompt_eval_count == chat.usage.prompt_tokens and whole.eval_count == chat.usage.completion_tokens

    # Ollama streams unless told not to: NDJSON, one object a line
    with httpx.stream("POST", f"{server.url}/api/chat", timeout=60,
                      json={"model": name, "messages": ASK, "options": {"num_predict": 3}}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines()]
    assert [x["done"] for x in lines][-1] is True and lines[-1]["eval_count"] == 3


def test_generate_raw_and_templated(server, client, name):
    prompt = "The capital of France is"
    raw = client.generate(model=name, prompt=prompt, raw=True, options=GREEDY)
    plain = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    assert raw.response == plain["choices"][0]["text"] and raw.prompt_eval_count == plain["usage"]["prompt_tokens"]
    streamed = list(client.generate(model=name, prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    # not raw: the prompt (and system) is a chat's user turn under the chat template, as in Ollama
    templated = client.generate(model=name, prompt=ASK[1]["content"], system=ASK[0]["content"], options=GREEDY)
    assert templated.response == client.chat(model=name, messages=ASK, options=GREEDY).message.content
    assert templated.prompt_eval_count > raw.prompt_eval_count
    loaded = client.generate(model=name, prompt="")  # Ollama's "load the model": nothing generated
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_format_json_and_schema(client, name):
    ask = [{"role": "user", "content": "Describe a cat as JSON."}]
    # room for the model to close its object (16 tokens cut one off mid-way on one CPU's numerics)
    anything = client.chat(model=name, messages=ask, format="json", options={"temperature": 0, "num_predict": 96})
    assert anything.done_reason == "stop", anything.message.content
    assert isinstance(json.loads(anything.message.content), dict)
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    shaped = client.generate(model=name, prompt="How old is the cat?", format=schema,
                             options={"temperature": 0, "num_predict": 16})
    assert isinstance(json.loads(shaped.response)["age"], int)


def test_model_listings(server, client, name):
    served = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert name == served["id"] + ":latest"
    (listed,) = client.list().models
    assert listed.size > 0 and len(listed.digest) == 64 and listed.details.format == "gguf"
    assert listed.details.family == "llama" and listed.details.parameter_size.endswith("M")
    assert listed.details.quantization_level == "Q4_1"
    for model in (name, served["id"]):  # with the tag or without
        shown = client.show(model)
        assert shown.modelinfo["llama.context_length"] == served["max_model_len"]
        assert "completion" in shown.capabilities and shown.details == listed.details and shown.template
    (running,) = client.ps().models
    assert running.model == name and running.context_length == served["max_model_len"]
    assert httpx.get(f"{server.url}/api/version").json() == {"version": nanoinfer.__version__}
    assert client.chat(model=served["id"], messages=ASK, options={"num_predict": 1}).eval_count == 1


def test_errors_in_ollamas_format(server, client, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404 and e.value.error == "model 'no-such-model' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=ASK, options={"temperature": -1}, stream=True).__next__()
    assert e.value.status_code == 400 and "temperature" in e.value.error
    r = httpx.post(f"{server.url}/api/chat", json={"model": name, "messages": ASK, "options": {"temperature": -1}})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    images = [{"role": "user", "content": "What is this?", "images": ["iVBORw0KGgo="]}]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=images)
    assert e.value.status_code == 400 and "images" in e.value.error
    refused = [{"think": True}, {"options": {"mirostat": 2}}, {"options": {"num_predict": 0}}, {"format": "yaml"}]
    for extra in refused:
        r = httpx.post(f"{server.url}/api/chat", json={"model": name, "messages": ASK, **extra})
        assert r.status_code == 400 and set(r.json()) == {"error"}, extra
    for extra in [{"template": "{{ .Prompt }}"}, {"context": [1, 2]}, {"raw": True, "system": "x"},
                  {"suffix": "return 1"}]:  # (no fill-in-the-middle tokens in this vocabulary)
        r = httpx.post(f"{server.url}/api/generate", json={"model": name, "prompt": "def f():", **extra})
        assert r.status_code == 400 and set(r.json()) == {"error"}, extra
    r = httpx.post(f"{server.url}/api/chat", json={"model": name, "messages": ASK, "stream": False, "options": {
        "num_predict": 1, "num_ctx": 1 << 20, "num_thread": 64, "num_gpu": 99, "repeat_last_n": 64}, "keep_alive": "5m"})
    assert r.status_code == 200 and r.json()["eval_count"] == 1  # options that change nothing here: accepted


def test_a_stream_that_fails_midway_ends_with_an_error_line():
    """What Serving's stream says when the engine fails mid-reply, as the NDJSON lines Ollama's clients read."""
    async def events():
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        yield sse({"choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}]})
        yield sse({"error": {"message": "internal error: RuntimeError", "type": "server_error"}})
        yield sse("[DONE]")

    async def lines() -> list[dict]:
        return [json.loads(x) async for x in routes._ndjson(routes._pieces(events(), 0), "m", routes._chat_shape)]

    first, last = asyncio.run(lines())
    assert first["message"] == {"role": "assistant", "content": "Par"} and first["done"] is False
    assert last == {"error": "internal error: RuntimeError"}


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_calls_both_ways(tiny_tokenizer_dir):
    """A reply's call comes back as Ollama's (arguments an object), streamed and not; a
    conversation carrying a call and the tool's answer goes back in."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    with run_server([], command=scripted_server_command(tiny_tokenizer_dir, {"Oslo": text, "sunny": "Fine."})) as url:
        client = ollama.Client(host=url, timeout=60)
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        whole = client.chat(model="scripted", messages=ask, tools=WEATHER)
        call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        assert whole.message.content == "" and [c.model_dump() for c in whole.message.tool_calls] == [call]
        assert whole.done_reason == "stop"
        streamed = [c.model_dump() for p in client.chat(model="scripted", messages=ask, tools=WEATHER, stream=True)
                    for c in p.message.tool_calls or []]
        assert streamed == [call]
        turns = [*ask, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": "12 C and sunny", "tool_name": "get_weather"}]
        assert client.chat(model="scripted", messages=turns, tools=WEATHER).message.content == "Fine."


def test_embed_equals_openai_embeddings(server, client, name):
    """/api/embed and /api/embeddings give /v1/embeddings' vectors (L2-normalised), a text's the
    same alone and among others; an input past the window is cut (truncate) or refused."""
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b"]
    out = client.embed(model=name, input=texts)
    assert out.prompt_eval_count > 0 and len(out.embeddings) == 2
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    ref = oa.embeddings.create(model=name.removesuffix(":latest"), input=texts, encoding_format="float")
    assert [list(v) for v in out.embeddings] == [d.embedding for d in ref.data]
    assert list(client.embed(model=name, input=texts[1]).embeddings[0]) == ref.data[1].embedding
    assert list(client.embeddings(model=name, prompt=texts[0]).embedding) == ref.data[0].embedding
    assert sum(x * x for x in out.embeddings[0]) == pytest.approx(1.0, abs=1e-5)
    long = "word " * 9000  # past the 8192-token window
    assert len(client.embed(model=name, input=long).embeddings[0]) == len(ref.data[0].embedding)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=name, input=long, truncate=False)
    assert e.value.status_code == 400 and "context window" in e.value.error
