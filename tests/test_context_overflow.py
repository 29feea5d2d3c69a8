"""Prompts longer than the window, as the caller chooses (server/overflow.py), against a real
server with a 160-token window: truncate_prompt_tokens on completions and chat keeps exactly
the prompt's last k tokens, chat's "truncation": "auto" drops exactly the oldest whole turns
that must go (the prompt the server ran is the one the kept messages render to), what was cut
is said in a header, and without either the request is a 400 with both numbers."""
from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from server_utils import start_server

WINDOW = 160
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served name: the default model's file name


@pytest.fixture(scope="module")
def server(default_gguf):
    s = start_server(["--model", str(default_gguf), "--max-model-len", str(WINDOW), "--kv-cache-memory", "32M",
                      "--log-level", "warning"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def prompt_ids(choice_prompt_logprobs) -> list[int]:
    """The prompt's ids after its first, from vLLM's prompt_logprobs (each entry holds its own token)."""
    return [int(next(iter(entry))) for entry in choice_prompt_logprobs[1:]]


LONG = " ".join(f"item {i} is a word" for i in range(60))  # ~300 tokens


def test_completions_keep_the_last_tokens(server, client):
    full = tokenize(server, prompt=LONG)
    assert len(full) > WINDOW
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=LONG, max_tokens=0, echo=True, logprobs=0,
        extra_body={"truncate_prompt_tokens": 40})
    r = raw.parse()
    assert r.usage.prompt_tokens == 40
    assert raw.headers["x-truncated-prompt-tokens"] == str(len(full) - 40)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": full[-40:]}).json()["prompt"]
    assert r.choices[0].text == text  # the echo is the kept prompt, exactly
    # token ids: cut the same way, and -1 keeps what the window leaves beside max_tokens
    r = client.completions.create(model=MODEL, prompt=full, max_tokens=10, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1, "prompt_logprobs": 0})
    assert r.usage.prompt_tokens == WINDOW - 10
    assert prompt_ids(r.choices[0].prompt_logprobs) == full[-(WINDOW - 10) + 1:]
    short = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=1,
                                                        extra_body={"truncate_prompt_tokens": 40})
    assert "x-truncated-prompt-tokens" not in short.headers  # nothing to cut, nothing said


def test_without_truncation_a_long_prompt_is_refused_with_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded" and str(WINDOW) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("value", [0, -2, WINDOW + 1])
def test_out_of_range_truncation_is_refused(client, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"truncate_prompt_tokens": value})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_fill_in_the_middle_is_not_cut(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(", suffix="\n", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 4})
    assert e.value.body["param"] in ("truncate_prompt_tokens", "suffix")


def chat_turns() -> list[dict]:
    messages = [{"role": "system", "content": "You answer in one word."}]
    for i in range(6):
        messages += [{"role": "user", "content": f"Question {i}: what comes after {i} in counting, spelled out?"},
                     {"role": "assistant", "content": f"The number after {i} is {i + 1}, spelled out in letters."}]
    return messages + [{"role": "user", "content": "And after ten?"}]


def test_chat_auto_truncation_drops_the_oldest_turns(server, client):
    messages = chat_turns()
    max_tokens = 12
    full = tokenize(server, messages=messages)
    assert len(full) + max_tokens > WINDOW
    # the expected prompt: the fewest oldest turns (user + reply) dropped after the system prompt
    for dropped in range(1, 7):
        kept = messages[:1] + messages[1 + 2 * dropped:]
        expected = tokenize(server, messages=kept)
        if len(expected) + max_tokens <= WINDOW:
            break
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"truncation": "auto", "prompt_logprobs": 0})
    r = raw.parse()
    assert raw.headers["x-truncated-messages"] == str(2 * dropped)
    assert r.usage.prompt_tokens == len(expected)
    assert prompt_ids(r.model_extra["prompt_logprobs"]) == expected[1:]
    alone = client.chat.completions.create(model=MODEL, messages=kept, max_tokens=max_tokens, temperature=0)
    assert alone.choices[0].message.content == r.choices[0].message.content
    # a chat that fits is not touched
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages[:1] + messages[-1:], max_tokens=max_tokens, extra_body={"truncation": "auto"})
    assert "x-truncated-messages" not in raw.headers


def test_chat_auto_truncation_keeps_the_last_turn(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": LONG}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_body={"truncation": "auto"})
    assert e.value.body["code"] == "context_length_exceeded" and "last turn" in e.value.body["message"]


def test_chat_truncate_prompt_tokens(server, client):
    messages = [{"role": "user", "content": LONG}]
    full = tokenize(server, messages=messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       extra_body={"truncate_prompt_tokens": 50, "prompt_logprobs": 0})
    assert r.usage.prompt_tokens == 50
    assert prompt_ids(r.model_extra["prompt_logprobs"]) == full[-49:]
