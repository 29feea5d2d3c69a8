"""Anthropic's Messages API (server/routes/anthropic.py) with the official `anthropic` SDK against
a real server with --api-key (the SDK sends it as x-api-key): messages.create's text equal to
chat completions' for the same conversation, messages.stream's events, a tool_use / tool_result
round trip, count_tokens, and errors in Anthropic's format."""
from __future__ import annotations

import anthropic
import httpx2 as httpx
import openai
import pytest

from server_utils import start_server

KEY = "anthropic-test-key"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(default_gguf):
    s = start_server(["--model", str(default_gguf), "--kv-cache-memory", "48M", "--api-key", KEY,
                      "--log-level", "warning"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]


SYSTEM = "You are a helpful assistant. Answer briefly."
GREEDY = {"temperature": 0}  # (this SDK has no temperature argument; the API takes it, as Anthropic's does)
TURNS = [{"role": "user", "content": "What is the capital of France?"}]


def test_create_matches_chat_completions(server, client, model):
    msg = client.messages.create(model=model, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=16, temperature=0)
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    # a stop sequence: stop_reason stop_sequence, and which one
    words = msg.content[0].text.split()
    if len(words) > 2:
        stopped = client.messages.create(model=model, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY,
                                         stop_sequences=[words[1]])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[1]


def test_stream_gives_the_same_message(client, model):
    whole = client.messages.create(model=model, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY)
    with client.messages.stream(model=model, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_and_tool_result_round_trip(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=model, messages=ask, tools=[WEATHER], tool_choice={"type": "any"},
                                   max_tokens=64, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict)
    follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    second = client.messages.create(model=model, messages=follow, tools=[WEATHER], max_tokens=24, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt
    counted = client.messages.count_tokens(model=model, messages=follow, tools=[WEATHER])
    assert counted.input_tokens == second.usage.input_tokens
    # streamed, the forced call arrives as a tool_use block with its input
    with client.messages.stream(model=model, messages=ask, tools=[WEATHER], tool_choice={"type": "any"},
                                max_tokens=64, extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == [b.type for b in first.content]
    assert next(b for b in streamed.content if b.type == "tool_use").input == use.input


def test_errors_in_anthropics_format(server, client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                   json={"model": model, "messages": TURNS})  # max_tokens is required
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=8, messages=TURNS,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=8, messages=TURNS)
