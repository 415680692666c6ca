"""Tool calling (chat/tools.py) with the official openai client, in process over httpx's
ASGI transport on a tiny model with a real tokenizer: named and required calls whose
arguments parse and validate (sync and streamed), calls parsed from the model's own text
(auto), a second turn with the tool's result, and the 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from swaserve.chat.tools import parse_auto
from tests.conftest import inprocess_app, run_client

pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "the weather in a city"}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMA = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def app(tiny_long_context):  # the tool list in the prompt is ~600 byte-level tokens
    yield from inprocess_app(tiny_long_context, kv_memory="32MiB", max_running_requests=8,
                             max_model_len=2048)



def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


async def streamed(client, **kw) -> tuple[list, str]:
    """A streamed chat's tool calls, merged from their deltas as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    finish = None
    async for ev in await client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = t.id or c["id"]
                if t.function is not None:
                    c["name"] = t.function.name or c["name"]
                    c["arguments"] += t.function.arguments or ""
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"])
def test_named_and_required_calls_parse_and_validate_sync_and_streamed(app, choice):
    kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
          "max_tokens": 120}

    async def fn(client, http):
        greedy = await client.chat.completions.create(temperature=0, **kw)
        seeded = await client.chat.completions.create(temperature=1.0, seed=4, n=3, **kw)
        stream = await streamed(client, temperature=0, **kw)
        return greedy, seeded, stream

    greedy, seeded, (calls, finish) = run_client(app, fn)
    for ch in greedy.choices + seeded.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        [call] = ch.message.tool_calls
        check_call(call)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
    assert finish == "tool_calls" and len(calls) == 1
    want = greedy.choices[0].message.tool_calls[0].function
    assert (calls[0]["name"], calls[0]["arguments"]) == (want.name, want.arguments)
    assert calls[0]["id"].startswith("call_")


def test_auto_reads_calls_from_the_model_text(app):
    """auto: the model's own text is parsed; here a schema makes it write a call (a real
    model writes it because the prompt lists the tools), and without one it is content."""
    call_format = {"type": "object", "properties": {
        "name": {"const": "add"}, "arguments": ADD}, "required": ["name", "arguments"]}

    async def fn(client, http):
        kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 60,
              "temperature": 0}
        call = await client.chat.completions.create(
            response_format={"type": "json_schema",
                             "json_schema": {"name": "c", "schema": call_format}}, **kw)
        stream = await streamed(client, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": call_format}}, **kw)
        text = await client.chat.completions.create(extra_body={"regex": "[a-z ]{1,20}"}, **kw)
        return call, stream, text

    call, (calls, finish), text = run_client(app, fn)
    [c] = call.choices[0].message.tool_calls
    assert c.function.name == "add" and call.choices[0].finish_reason == "tool_calls"
    check_call(c)
    assert finish == "tool_calls" and calls[0]["arguments"] == c.function.arguments
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_a_second_turn_carries_the_call_and_its_result(app):
    async def fn(client, http):
        first = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
            temperature=0)
        call = first.choices[0].message.tool_calls[0]
        history = ASK + [{"role": "assistant", "content": None,
                          "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id,
                          "content": '{"temperature": 21}'}]
        second = await client.chat.completions.create(model="tiny", messages=history,
                                                      tools=TOOLS, max_tokens=8)
        rendered = await http.post("/tokenize", json={"messages": history})
        text = await http.post("/detokenize", json={"tokens": rendered.json()["tokens"]})
        return call, second, text.json()["prompt"]

    call, second, prompt = run_client(app, fn)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the built-in template writes the call as the model turn and the result as a user turn
    written = json.dumps({"name": call.function.name,
                          "arguments": json.loads(call.function.arguments)})
    assert f"<start_of_turn>model\n{written}<end_of_turn>" in prompt
    assert f"Result of {call.function.name}: {{\"temperature\": 21}}" in prompt
    assert "You can call these functions" not in prompt  # /tokenize renders without tools


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
])
def test_bad_tool_requests_are_400s_naming_the_field(app, body, param):
    async def fn(client, http):
        return await http.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 4, **body})

    r = run_client(app, fn)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("text, names", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ["add"]),
    ('  {"name": "add", "parameters": {"a": 1, "b": 2}}\n', ["add"]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', ["get_weather"]),
    ('```tool_code\n[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}]```',
     ["add", "add"]),
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', ["add", "get_weather"]),
    ("The weather is nice.", None),
    ('{"name": "launch_rockets", "arguments": {}}', None),  # not a declared tool
    ('{"name": "add", "arguments": [1, 2]}', None),
    ('{"city": "Paris"}', None),
])
def test_auto_call_formats(text, names):
    calls = parse_auto(text, SCHEMA)
    if names is None:
        assert calls is None
    else:
        assert [c["function"]["name"] for c in calls] == names
        for c in calls:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
