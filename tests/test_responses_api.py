"""OpenAI's Responses API (server/routes/responses.py) with the official `openai` client against a
real server: responses.create's text and usage equal to chat completions' for the same
conversation, the streamed event sequence, text.format json_schema, previous_response_id (and
store: false, GET, DELETE), refusals by name, max_output_tokens -> incomplete; a function call
round trip on a scripted model; and the replica router's affinity for stored responses."""
from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from nanoinfer.server.replicas import RouterState, pinned_replica, routing_text
from nanoinfer.server.response_store import ResponseStore, StoredResponse
from nanoinfer.server.routes import ROUTES

from server_utils import run_server, scripted_server_command

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_create_matches_chat_completions(client, model):
    r = client.responses.create(model=model, instructions=SYSTEM, input=QUESTION, **GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model and r.error is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    length = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if length else "completed") and message.status == r.status
    assert (r.incomplete_details.reason if length else r.incomplete_details) == ("max_output_tokens" if length else None)
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store, r.truncation) == (SYSTEM, 12, 0, True,
                                                                                           "disabled")
    # the same conversation as items: a developer message and input_text parts
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    assert client.responses.create(model=model, input=items, **GREEDY).output_text == r.output_text
    # include: the output text's logprobs, one entry per token, with its top alternatives
    lp = client.responses.create(model=model, instructions=SYSTEM, input=QUESTION, top_logprobs=2,
                                 include=["message.output_text.logprobs"], **GREEDY).output[0].content[0]
    assert lp.text == r.output_text and "".join(t.token for t in lp.logprobs).startswith(lp.text)  # (and EOS)
    assert len(lp.logprobs) == r.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in lp.logprobs)


def test_max_output_tokens_makes_it_incomplete(client, model):
    r = client.responses.create(model=model, input="Write a long story about a dragon.", temperature=0,
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_stream_events_and_final_response(client, model):
    whole = client.responses.create(model=model, instructions=SYSTEM, input=QUESTION, **GREEDY)
    events = list(client.responses.create(model=model, instructions=SYSTEM, input=QUESTION, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    assert final.output[0].id == item_id
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored once finished


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="Pick a color.", temperature=0, max_output_tokens=16,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    with pytest.raises(openai.BadRequestError) as e:  # a bad schema is named as this request names it
        client.responses.create(model=model, input="x", max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "bad", "schema": {"type": 3}}})
    assert e.value.body["param"].startswith("text.format")


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, instructions=SYSTEM, input="Name a color.", **GREEDY)
    follow = "And another one?"
    second = client.responses.create(model=model, previous_response_id=first.id, input=follow, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # the same as sending the whole conversation, without the first's instructions (not carried over)
    explicit = client.responses.create(model=model, **GREEDY, input=[
        {"role": "user", "content": "Name a color."}, *[item.model_dump() for item in first.output],
        {"role": "user", "content": follow}])
    assert (second.output_text, second.usage.input_tokens) == (explicit.output_text, explicit.usage.input_tokens)
    # GET gives back the stored response; DELETE forgets it
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage.input_tokens) == (first.id, first.output_text, first.usage.input_tokens)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, previous_response_id=first.id, input=follow, **GREEDY)
    assert e.value.code == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_store_false_is_not_kept(client, model):
    r = client.responses.create(model=model, input="Hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, previous_response_id=r.id, input="again", **GREEDY)
    assert e.value.code == "previous_response_not_found"


@pytest.mark.parametrize("extra,named", [
    ({"tools": [{"type": "web_search_preview"}]}, "web_search_preview"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "file_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input_image"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "web_search_call"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
])
def test_refusals_name_what_is_not_supported(client, model, extra, named):
    body = {"model": model, "input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert named in e.value.body["message"] or named in (e.value.body["param"] or "")
    assert e.value.status_code == 400


def test_errors_name_this_requests_fields(server, model):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": model, "input": "Hi", "max_output_tokens": 10**9},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert "max_output_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/responses", json={"model": model}, timeout=30)  # nothing to answer
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


# --- a function call round trip (a scripted model: a random one writes no reliable calls) --------
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'  # no newline: the script rule
SCRIPTS = {"WEATHER?": CALL, "RESULT:": "It is sunny in Paris.", "HELLO?": "Hello! No tools needed."}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer_dir):
    with run_server([], command=scripted_server_command(tiny_tokenizer_dir, SCRIPTS)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def test_function_call_round_trip(scripted):
    first = scripted.responses.create(model="scripted", input="WEATHER?", tools=[WEATHER])
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert first.status == "completed" and first.output_text == "" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "RESULT: 18 C"}
    # the model saw the call's result (its keyword, last in the prompt, chose the script)
    second = scripted.responses.create(model="scripted", previous_response_id=first.id, input=[result],
                                       tools=[WEATHER])
    assert second.output_text == SCRIPTS["RESULT:"] and second.status == "completed"
    explicit = scripted.responses.create(model="scripted", tools=[WEATHER], input=[
        {"role": "user", "content": "WEATHER?"}, call.model_dump(), result])
    assert (explicit.output_text, explicit.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    assert scripted.responses.create(model="scripted", input="WEATHER?", tools=[WEATHER],
                                     tool_choice="none").output_text == CALL  # no tools: the text as written


def test_function_call_and_text_streamed(scripted):
    events = list(scripted.responses.create(model="scripted", input="WEATHER?", tools=[WEATHER], stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done, final = events[2].item, events[5].item, events[-1].response
    assert added.type == "function_call" and added.status == "in_progress" and done.status == "completed"
    assert events[3].delta == events[4].arguments == done.arguments and json.loads(done.arguments) == {"city": "Paris"}
    assert final.output[0].call_id == done.call_id == added.call_id
    # the SDK's stream helper accumulates the events into the final response
    with scripted.responses.stream(model="scripted", input="HELLO?") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == SCRIPTS["HELLO?"] and kinds[-1] == "response.completed"


def test_the_store_forgets_the_least_recently_used():
    store = ResponseStore(max_responses=2, max_bytes=100)
    for rid in "ab":
        store.put(rid, StoredResponse({}, [], 10))
    store.get("a")  # used: "b" is now the least recently used
    store.put("c", StoredResponse({}, [], 10))
    assert list(store.entries) == ["a", "c"] and store.bytes == 20
    store.put("d", StoredResponse({}, [], 95))  # over the bytes: the older ones go
    assert list(store.entries) == ["d"] and store.bytes == 95
    store.put("e", StoredResponse({}, [], 500))  # one over the budget alone is still kept, alone
    assert list(store.entries) == ["e"]
    assert store.delete("e") and not store.delete("e") and store.bytes == 0 and store.get("e") is None


# --- behind --replicas: a stored response's requests reach the replica that stored it -----------
def test_router_sends_previous_response_id_to_its_replica():
    rid = "resp_r2_" + "ab" * 16
    body = json.dumps({"previous_response_id": rid, "input": "more"}).encode()
    assert pinned_replica(ROUTES, "POST", "/v1/responses", body) == 2
    assert pinned_replica(ROUTES, "GET", f"/v1/responses/{rid}", b"") == 2
    assert pinned_replica(ROUTES, "DELETE", f"/v1/responses/{rid}", b"") == 2
    assert pinned_replica(ROUTES, "POST", "/v1/responses", b'{"input": "new"}') is None  # a new conversation
    assert pinned_replica(ROUTES, "GET", "/v1/responses/resp_" + "ab" * 16, b"") is None  # a single server's id
    assert pinned_replica(ROUTES, "POST", "/v1/chat/completions", body) is None  # a route without affinity
    state = RouterState(3)
    text = routing_text(ROUTES, "POST", "/v1/responses", body)
    assert [state.choose(text, 2) for _ in range(3)] == [2, 2, 2]  # however busy it is, and whatever the prefix
    assert state.routed[(2, "affinity")] == 3
    state.dead_until[2] = float("inf")  # that replica is gone: another answers (previous_response_not_found)
    assert state.choose(text, 2) in (0, 1)
    assert state.choose(text, 7) in (0, 1)  # no such replica
    assert RouterState(2, policy="round-robin").choose(text, 1) == 1
