"""Structured outputs through the server, with the official `openai` client, on the default
model: `chat.completions.parse` with a Pydantic model, `response_format` json_object and
json_schema (streamed too), vLLM's `guided_*` extras and `structured_outputs`, and
`tool_choice` "required" / a named function yielding valid tool calls where the model,
unconstrained, answers in prose."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from server_utils import run_server

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(default_gguf):
    args = ["--model", str(default_gguf), "--max-model-len", "2048", "--kv-cache-memory", "64M",
            "--log-level", "warning"]
    with run_server(args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=model_of(client), temperature=0, max_tokens=256,
        messages=[{"role": "user", "content": "Invent a person and give their name and age."}],
        response_format=Person)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and message.parsed.name


def test_json_object_and_schema_streamed(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["color", "count"]}
    stream = client.chat.completions.create(
        model=model_of(client), temperature=1.0, seed=4, max_tokens=128, stream=True,
        messages=[{"role": "user", "content": "Pick a color and a count."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"
    out = client.chat.completions.create(
        model=model_of(client), temperature=0, max_tokens=256, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with its name and color."}])
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_vllm_extras(client):
    model = model_of(client)
    out = client.completions.create(model=model, prompt="A date:", max_tokens=20, temperature=1.0, seed=1,
                                    extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.choices[0].text)
    out = client.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=5, temperature=1.0,
                                    seed=2, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    out = client.chat.completions.create(model=model, max_tokens=64, temperature=0,
                                         messages=[{"role": "user", "content": "Give a list of two numbers."}],
                                         extra_body={"structured_outputs": {"json": {
                                             "type": "array", "items": {"type": "integer"},
                                             "minItems": 2, "maxItems": 2}}})
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, list) and len(value) == 2


def check_calls(message, only: str | None = None) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.function.name in PARAMS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


PROSE = [[{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "user", "content": "Hello! How are you?"}]]


def test_tool_choice_required_always_calls(client):
    model = model_of(client)
    free = client.chat.completions.create(model=model, messages=PROSE[0], tools=TOOLS, temperature=0, max_tokens=64)
    assert not free.choices[0].message.tool_calls  # unconstrained, the model answers in prose
    for messages in PROSE:
        for seed in (None, 1, 2):
            out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                                 temperature=0 if seed is None else 1.0, seed=seed, max_tokens=256)
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
            check_calls(out.choices[0].message)


def test_named_tool_choice(client):
    out = client.chat.completions.create(model=model_of(client), messages=PROSE[1], tools=TOOLS, max_tokens=128,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         temperature=1.0, seed=3)
    check_calls(out.choices[0].message, only="get_time")
    assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("temperature,seed", [(1.0, 1)])
def test_schema_suite_through_the_server(client, temperature, seed):
    """The 21 schemas of test_structured_outputs.py through response_format (sent at once, so
    the engine batches them), sampled (the greedy suite runs offline): every one ends with
    `stop` and validates."""
    from concurrent.futures import ThreadPoolExecutor

    from test_structured_outputs import PROMPT, SCHEMAS

    model = model_of(client)

    def ask(item):
        name, schema = item
        return client.chat.completions.create(
            model=model, temperature=temperature, seed=seed, max_tokens=256,
            messages=[{"role": "user", "content": PROMPT.format(name, json.dumps(schema))}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(ask, SCHEMAS))
    for choice, (name, schema) in zip(choices, SCHEMAS):
        assert choice.finish_reason == "stop", (name, choice.message.content[-80:])
        jsonschema.validate(json.loads(choice.message.content), schema)
