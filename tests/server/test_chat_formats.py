"""Chat in each family's own format, end to end with the official `openai` client: tiny
random gpt-oss and Qwen3 models with their real tokenizers and chat templates, whose
outputs are scripted (tests/helpers/scripted.py), answer with `reasoning_content`,
`content` and `tool_calls` as vLLM shapes them, streamed and whole alike."""

from __future__ import annotations

import json

from tests.conftest import run_client
from tests.server.conftest import script_chat as _script

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _ask(served, stream: bool, **kw):
    """(message-like dict, finish_reason, usage) from one chat call, streamed or not."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 200, **kw}

    async def go(client, http):
        if not stream:
            r = await client.chat.completions.create(**body)
            m = r.choices[0].message
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in (m.tool_calls or [])]
            return ({"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
                     "calls": calls}, r.choices[0].finish_reason, r.usage)
        s = await client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True})
        content, reasoning, calls, order, finish, usage = "", "", {}, [], None, None
        async for chunk in s:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                d = ch.delta
                if d.content:
                    content += d.content
                    order.append("content")
                if getattr(d, "reasoning_content", None):
                    reasoning += d.reasoning_content
                    order.append("reasoning")
                for c in d.tool_calls or []:
                    order.append("call")
                    slot = calls.setdefault(c.index, {"id": None, "name": None,
                                                      "arguments": ""})
                    if c.id:
                        slot["id"], slot["name"] = c.id, c.function.name
                    slot["arguments"] += c.function.arguments or ""
                finish = ch.finish_reason or finish
        return ({"content": content or None, "reasoning": reasoning or None,
                 "calls": [calls[k] for k in sorted(calls)], "order": order}, finish, usage)

    return run_client(served[0], go)


def _same(a: dict, b: dict) -> None:
    """A whole answer and a streamed one say the same (call ids are each answer's own)."""
    def norm(m):
        return (m["content"] or None, m["reasoning"],
                [(c["name"], json.loads(c["arguments"])) for c in m["calls"]])
    assert norm(a) == norm(b)


HARMONY_ANSWER = ("<|channel|>analysis<|message|>The user asks about weather.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|>"
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                '<|message|>{"city": "Paris"}<|call|>')


def test_gpt_oss_reasoning_and_content(gpt_oss_chat):
    _script(gpt_oss_chat, HARMONY_ANSWER)
    whole, finish, usage = _ask(gpt_oss_chat, stream=False)
    assert whole == {"content": "It is sunny in Paris.",
                     "reasoning": "The user asks about weather.", "calls": []}
    assert finish == "stop"
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    streamed, finish, usage_s = _ask(gpt_oss_chat, stream=True)
    _same(whole, streamed)
    assert finish == "stop"
    assert streamed["order"][0] == "reasoning" and streamed["order"][-1] == "content"
    assert usage_s.completion_tokens_details.reasoning_tokens \
        == usage.completion_tokens_details.reasoning_tokens


def test_gpt_oss_tool_call(gpt_oss_chat):
    _script(gpt_oss_chat, HARMONY_CALL)
    for stream in (False, True):
        answer, finish, _ = _ask(gpt_oss_chat, stream=stream, tools=TOOLS)
        assert finish == "tool_calls"
        assert answer["reasoning"] == "Need the tool." and not answer["content"]
        assert [(c["name"], json.loads(c["arguments"])) for c in answer["calls"]] \
            == [("get_weather", {"city": "Paris"})]
        assert answer["calls"][0]["id"].startswith("call_")


def test_gpt_oss_named_call_in_harmony_syntax(gpt_oss_chat):
    """A named call is constrained to Harmony's own syntax: the scripted call passes the
    grammar token by token, and a grammar error would end the request early."""
    _script(gpt_oss_chat, HARMONY_CALL.removesuffix("<|call|>"))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        answer, finish, _ = _ask(gpt_oss_chat, stream=stream, tools=TOOLS, tool_choice=choice)
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in answer["calls"]] \
            == [("get_weather", {"city": "Paris"})]


def test_gpt_oss_json_answer_after_analysis(gpt_oss_chat):
    _script(gpt_oss_chat, "<|channel|>analysis<|message|>Count.<|end|><|start|>assistant"
            '<|channel|>final<|message|>{"n": 4}')
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    answer, finish, _ = _ask(gpt_oss_chat, stream=False, response_format=fmt)
    assert (answer["reasoning"], answer["content"], finish) == ("Count.", '{"n": 4}', "stop")


QWEN_CALLS = ("<think>\nThe user wants weather.\n</think>\n\nLet me check.\n"
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_qwen3_thinking_content_and_parallel_calls(qwen3_chat):
    _script(qwen3_chat, QWEN_CALLS)
    whole, finish, usage = _ask(qwen3_chat, stream=False, tools=TOOLS)
    assert finish == "tool_calls"
    assert whole["reasoning"].strip() == "The user wants weather."
    assert whole["content"].strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in whole["calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    streamed, finish_s, _ = _ask(qwen3_chat, stream=True, tools=TOOLS)
    _same(whole, streamed)
    assert finish_s == "tool_calls"
    # the content streamed before the first call's delta
    assert streamed["order"].index("content") < streamed["order"].index("call")
    # parallel_tool_calls: false keeps the first call only
    one, _, _ = _ask(qwen3_chat, stream=False, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in one["calls"]] == ["get_weather"]


def test_qwen3_without_tools_the_markup_is_content(qwen3_chat):
    _script(qwen3_chat, "<think>\nhm\n</think>\n\nHello!")
    answer, finish, _ = _ask(qwen3_chat, stream=False)
    assert (answer["reasoning"].strip(), answer["content"], finish) == ("hm", "Hello!", "stop")


def test_two_turn_tool_exchange_renders_through_the_template(gpt_oss_chat):
    """The call goes back as the template writes it, and /tokenize counts exactly the
    prompt the chat sends."""
    _script(gpt_oss_chat, HARMONY_CALL)
    answer, _, _ = _ask(gpt_oss_chat, stream=False, tools=TOOLS)
    call = answer["calls"][0]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'}]
    _script(gpt_oss_chat, "<|channel|>final<|message|>Sunny.<|return|>")

    async def go(client, http):
        r = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                 max_tokens=20)
        tok = await http.post("/tokenize", json={"model": "tiny", "messages": history,
                                                 "tools": TOOLS})
        det = await http.post("/detokenize", json={"tokens": tok.json()["tokens"]})
        return r, tok.json(), det.json()["prompt"]

    r, tok, prompt = run_client(gpt_oss_chat[0], go)
    assert r.choices[0].message.content == "Sunny."
    assert r.usage.prompt_tokens == tok["count"]
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>') in prompt
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>' \
        in prompt
