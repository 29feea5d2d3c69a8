"""llama.cpp's server API (server/routes/llama_cpp.py) against a real server: /completion in
llama.cpp's field names and response shape (greedy text equal to /v1/completions'), its
stream (pieces, then a last event with "stop": true, no [DONE]), /props, /infill's prompt
(the family's FIM tokens around prefix and suffix, asserted on the ids) and its refusal
on a vocabulary without FIM tokens; an unknown route's 404 lists the APIs served."""
from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from server_utils import start_server

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def fim_server(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    """A tiny random Qwen2 whose vocabulary has Qwen2.5-Coder's FIM tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from conftest import _hf_model

    folder = tmp_path_factory.mktemp("fim_model")
    backend = Backend.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    for f in tiny_tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    backend.save(str(folder / "tokenizer.json"))
    _hf_model("qwen2", backend.get_vocab_size(), tie=True).save_pretrained(folder)
    s = start_server(["--model", str(folder), "--log-level", "warning"])
    yield s, backend
    s.stop()


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_completion_in_llama_cpps_shape(server):
    prompt = "The capital of France is"
    r = post(server, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["stop_type"] in ("limit", "eos") and body["tokens_predicted"] <= 8
    openai = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert body["content"] == openai["choices"][0]["text"]
    assert body["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert body["stop_type"] == ("limit" if openai["choices"][0]["finish_reason"] == "length" else "eos")
    # a stop string: stop_type "word", and the word
    text = body["content"]
    word = text.strip().split()[0] if text.strip() else "Paris"
    r = post(server, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "stop": [word]}).json()
    if word in text:
        assert r["stop_type"] == "word" and r["stopping_word"] == word


def test_completion_stream(server):
    prompt = "Once upon a time"
    whole = post(server, "/completion", {"prompt": prompt, "n_predict": 10, "temperature": 0}).json()
    with httpx.stream("POST", f"{server.url}/completion", json={"prompt": prompt, "n_predict": 10,
                                                                 "temperature": 0, "stream": True}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_props_and_refusals(server):
    props = httpx.get(f"{server.url}/props").json()
    cards = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert props["default_generation_settings"]["n_ctx"] == cards["max_model_len"]
    assert "im_start" in props["chat_template"]
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": ")"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = post(server, "/completion", {"prompt": "Hi", "n_probs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs"
    r = post(server, "/completion", {"prompt": "Hi", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_unknown_routes_list_the_apis_served(server):
    r = post(server, "/v1/embedding-typo", {})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "no route POST /v1/embedding-typo" in message
    for family in ("OpenAI (", "llama.cpp (", "POST /completion", "POST /v1/chat/completions", "GET /props"):
        assert family in message


def test_infill_prompt_holds_the_fim_tokens_in_order(fim_server):
    server, backend = fim_server
    prefix, suffix, start = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", "a"
    r = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "prompt": start, "n_predict": 6,
                                 "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [backend.token_to_id(t) for t in FIM]

    def enc(text):
        return backend.encode(text, add_special_tokens=False).ids

    expected = [ids[0], *enc(prefix), ids[1], *enc(suffix), ids[2], *enc(start)]
    # the prompt as the server ran it: the same request on /completion with those ids gives the same middle
    same = post(server, "/completion", {"prompt": expected, "n_predict": 6, "temperature": 0}).json()
    assert body["tokens_evaluated"] == len(expected) and body["content"] == same["content"]
    assert body["tokens_predicted"] >= 1
