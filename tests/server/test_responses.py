"""OpenAI's Responses API (/v1/responses) end to end with the official `openai` client and
the `openai-agents` SDK, on the tiny chat models with scripted outputs
(tests/server/chat_models.py): reasoning, message and function_call items, the event
stream the client accumulates into the same response, structured text, a tool round
trip rendered through the real template, and refusals naming their field. Bad bodies
are in conftest.py's BAD."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.conftest import run_client
from tests.helpers.scripted import script_turns
from tests.server.chat_models import WEATHER, script

QUESTION = "What is the weather in Paris?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "description": "time",
          "parameters": {"type": "object", "properties": {}}}]
ANSWER = ("<|channel|>analysis<|message|>The user asks about weather.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
        '<|message|>{"city": "Paris"}<|call|>')


def _create(served, **kw):
    return run_client(served[0], lambda client, http: client.responses.create(
        model="tiny", input=kw.pop("input", QUESTION), max_output_tokens=200, **kw))


def _shape(response) -> list[tuple]:
    """The output items without their ids (each response has its own)."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", [c.text for c in item.content], item.summary))
        elif item.type == "message":
            out.append(("message", item.status, [(c.type, c.text) for c in item.content]))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments), item.status))
    return out


def test_reasoning_and_message_items(gpt_oss_chat):
    script(gpt_oss_chat, ANSWER)
    r = _create(gpt_oss_chat, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert _shape(r) == [("reasoning", ["The user asks about weather."], []),
                         ("message", "completed", [("output_text", "It is sunny in Paris.")])]
    assert r.output[0].id.startswith("rs_") and r.output[1].id.startswith("msg_")
    assert r.output_text == "It is sunny in Paris."
    u = r.usage
    assert 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert r.metadata == {"k": "v"} and r.store is False and r.tools == []


def test_stream_accumulates_to_the_same_response(gpt_oss_chat):
    script(gpt_oss_chat, ANSWER)

    async def go(client, http):
        whole = await client.responses.create(model="tiny", input=QUESTION,
                                              max_output_tokens=200)
        events = []
        async with client.responses.stream(model="tiny", input=QUESTION,
                                           max_output_tokens=200) as s:
            async for ev in s:
                events.append(ev)
            final = await s.get_final_response()
        return whole, events, final

    whole, events, final = run_client(gpt_oss_chat[0], go)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type.removeprefix("response.") for e in events]
    deltas = {"reasoning_text.delta", "output_text.delta"}
    assert [k for i, k in enumerate(kinds) if k not in deltas or kinds[i - 1] != k] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done", "completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == "It is sunny in Paris."
    assert _shape(final) == _shape(whole) and final.output_text == whole.output_text
    assert final.usage == whole.usage
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.id for e in added] == [item.id for item in final.output]


def test_every_event_and_response_validates_as_the_client_models(qwen3_chat):
    """The raw stream and body, checked strictly (required fields, literals) against the
    openai package's own models, with a tool call and a cut-short output."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    script(qwen3_chat, "<think>\nhm\n</think>\n\nLet me check.\n<tool_call>\n"
           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    body = {"model": "tiny", "input": QUESTION, "tools": TOOLS, "max_output_tokens": 200}

    async def go(client, http):
        return [await http.post("/v1/responses", json={**body, **kw})
                for kw in ({}, {"stream": True}, {"max_output_tokens": 6},
                           {"stream": True, "max_output_tokens": 6})]

    def events_of(r):
        blocks = [b.split("\n", 1) for b in r.text.split("\n\n") if b]
        events = [TypeAdapter(ResponseStreamEvent).validate_json(data.removeprefix("data: "))
                  for _, data in blocks]
        assert [name.removeprefix("event: ") for name, _ in blocks] == [e.type for e in events]
        return events

    whole, stream, cut, cut_stream = run_client(qwen3_chat[0], go)
    for r in (whole, cut):
        Response.model_validate(r.json())
    assert cut.json()["status"] == "incomplete"
    assert cut.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    last = events_of(stream)[-1]
    assert last.type == "response.completed"
    assert [i.type for i in last.response.output] == ["reasoning", "message", "function_call"]
    last = events_of(cut_stream)[-1]
    assert last.type == "response.incomplete" and last.response.output[-1].status == "incomplete"


def test_a_failure_mid_stream_is_response_failed():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from swaserve.server.errors import APIError
    from swaserve.server.events import Delta
    from swaserve.server.responses.answer import ResponsesFormat

    fmt = ResponsesFormat("tiny", {"tools": [], "tool_choice": "auto",
                                   "parallel_tool_calls": True}, None, None)
    text = "".join(fmt.event(obj) for obj in [*fmt.head(), fmt.chunk(Delta(0, "Hel", [1], [])),
                                              fmt.error(APIError(500, "the engine stopped",
                                                                 None, "server_error"))])
    events = [TypeAdapter(ResponseStreamEvent).validate_json(b.split("data: ", 1)[1])
              for b in text.split("\n\n") if b]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "the engine stopped"
    assert events[-1].response.output[0].content[0].text == "Hel"


def test_json_schema_text_format(gpt_oss_chat):
    class Count(BaseModel):
        n: int

    script(gpt_oss_chat, "<|channel|>analysis<|message|>Count.<|end|><|start|>assistant"
           '<|channel|>final<|message|>{"n": 4}')

    async def go(client, http):
        return await client.responses.parse(model="tiny", input="How many?",
                                            text_format=Count, max_output_tokens=100)

    r = run_client(gpt_oss_chat[0], go)
    assert r.output_parsed == Count(n=4) and r.output[0].content[0].text == "Count."
    assert r.text.format.type == "json_schema"


def test_named_function_call(gpt_oss_chat):
    script(gpt_oss_chat, CALL.removesuffix("<|call|>"))
    r = _create(gpt_oss_chat, tools=TOOLS, tool_choice={"type": "function",
                                                          "name": "get_weather"})
    assert _shape(r)[1:] == [("function_call", "get_weather", {"city": "Paris"}, "completed")]
    call = r.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] \
        == ["get_weather", "get_time"]


def test_qwen3_message_then_parallel_calls_streamed(qwen3_chat):
    script(qwen3_chat, "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n"
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')

    async def go(client, http):
        async with client.responses.stream(model="tiny", input=QUESTION, tools=TOOLS,
                                           max_output_tokens=200) as s:
            return await s.get_final_response()

    r = run_client(qwen3_chat[0], go)
    shape = _shape(r)
    assert [s[0] for s in shape] == ["reasoning", "message", "function_call",
                                     "function_call"]
    assert shape[1][2][0][1].strip() == "Let me check."
    assert [s[1:3] for s in shape[2:]] == [("get_weather", {"city": "Paris"}),
                                           ("get_time", {})]


def test_function_call_output_round_trip(gpt_oss_chat):
    """The first answer's items go back with the call's result: the second prompt holds
    the reasoning, the call and its result as gpt-oss's template writes them."""
    script(gpt_oss_chat, CALL)
    first = _create(gpt_oss_chat, tools=TOOLS)
    call = first.output[-1]
    assert call.type == "function_call"
    items = [{"role": "user", "content": QUESTION},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"sky": "sunny"}'}]
    chat = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                 "name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]
    script(gpt_oss_chat, "<|channel|>final<|message|>Sunny.<|return|>")

    async def go(client, http):
        r = await client.responses.create(model="tiny", input=items, tools=TOOLS,
                                          max_output_tokens=20)
        tok = await http.post("/tokenize", json={"messages": chat, "tools": chat_tools})
        det = await http.post("/detokenize", json={"tokens": tok.json()["tokens"]})
        return r, tok.json()["count"], det.json()["prompt"]

    r, count, prompt = run_client(gpt_oss_chat[0], go)
    assert r.output_text == "Sunny." and r.usage.input_tokens == count
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
            '<|message|>{"city": "Paris"}<|call|>') in prompt
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"{\\"sky\\": \\"sunny\\"}"') in prompt or '{"sky": "sunny"}<|end|>' in prompt


def test_refusals_name_their_field(gpt_oss_chat):
    async def go(client, http):
        out = []
        for kw in ({"tools": [{"type": "web_search"}]}, {"store": True},
                   {"input": [{"type": "function_call_output", "call_id": "x", "output": ""}]}):
            try:
                await client.responses.create(model="tiny", **{"input": QUESTION, **kw})
            except openai.BadRequestError as e:
                out.append(e.body["param"])
        out.append((await http.get("/v1/responses/resp_1")).status_code)
        return out

    assert run_client(gpt_oss_chat[0], go) == ["tools.0.type", "store", "input.0.call_id", 404]


def test_openai_agents_run(gpt_oss_chat):
    """An agent with a function tool and a typed output, on the SDK's default Responses
    model, run whole and streamed: the first turn calls the tool, the second answers in
    the output type."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    class Forecast(BaseModel):
        city: str
        sky: str

    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The sky over a city."""
        seen.append(city)
        return "sunny"

    eng = gpt_oss_chat[1].engine
    turns = [CALL, "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant"
             '<|channel|>final<|message|>{"city": "Paris", "sky": "sunny"}<|return|>']
    turns = [eng.tokenizer.encode(t, add_special_tokens=False) for t in turns]

    async def go(client, http):
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer about the weather.",
                             tools=[get_weather], output_type=Forecast, model=model)
        script_turns(eng, turns, end=eng.tokenizer.eos_token_ids[0])
        whole = await agents.Runner.run(agent, QUESTION, max_turns=3)
        script_turns(eng, turns, end=eng.tokenizer.eos_token_ids[0])
        streamed = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = run_client(gpt_oss_chat[0], go)
    assert seen == ["Paris", "Paris"]
    assert whole.final_output == streamed.final_output == Forecast(city="Paris", sky="sunny")


def test_live_server_responses(tiny_with_tokenizer):
    from tests.helpers.servers import start_server, stop_server

    base, proc = start_server("--model", tiny_with_tokenizer, "--dtype", "float32",
                              "--kv-memory", "16MiB", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.responses.create(model=client.models.list().data[0].id, input="hello",
                                    instructions="Be brief.", max_output_tokens=4,
                                    temperature=0)
        assert r.status in ("completed", "incomplete") and r.output[-1].type == "message"
        assert r.usage.output_tokens <= 4
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
    finally:
        stop_server(proc)
