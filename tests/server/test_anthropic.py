"""Anthropic's Messages API (/v1/messages) end to end with the official `anthropic` client,
on the tiny gpt-oss and Qwen3 chat models of test_chat_formats.py (real tokenizers and
templates, scripted outputs): thinking, text and tool_use blocks, whole and streamed alike,
tool results rendered through the template, count_tokens, errors in Anthropic's shape, and
the x-api-key header on a live server."""

from __future__ import annotations

import asyncio
import importlib
import json

import httpx
import pytest

from tests.conftest import start_server, stop_server
from tests.server.chat_models import script as _script
from tests.server.test_chat_formats import HARMONY_ANSWER, HARMONY_CALL, QWEN_CALLS

anthropic = pytest.importorskip("anthropic")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER},
         {"name": "get_time", "description": "time",
          "input_schema": {"type": "object", "properties": {}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _http():
    """The HTTP package the installed client is built on (httpx, or httpx2 in newer ones)."""
    cls = next(c for c in anthropic.DefaultAsyncHttpxClient.__mro__
               if c.__name__ == "AsyncClient" and c is not anthropic.DefaultAsyncHttpxClient)
    return importlib.import_module(cls.__module__.partition(".")[0])


def run_anthropic(app, fn):
    """fn(anthropic.AsyncAnthropic, its HTTP client) against the app in process."""
    hx = _http()

    async def go():
        async with hx.AsyncClient(transport=hx.ASGITransport(app=app), base_url="http://t",
                                  timeout=60) as http:
            client = anthropic.AsyncAnthropic(base_url="http://t", api_key="x",
                                              http_client=http, max_retries=0)
            return await fn(client, http)
    return asyncio.run(go())


def _blocks(message) -> list[dict]:
    """A message's content, tool_use ids checked and blanked (each answer mints its own)."""
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if d["type"] == "tool_use":
            assert d.pop("id").startswith("toolu_")
        out.append(d)
    return out


def _whole_and_streamed(served, **kw):
    """(message, streamed final message, text_stream's text, raw event types) of one body."""
    body = {"model": "tiny", "max_tokens": 200, "messages": USER, **kw}

    async def go(client, http):
        whole = await client.messages.create(**body)
        async with client.messages.stream(**body) as s:
            text = "".join([t async for t in s.text_stream])
            final = await s.get_final_message()
        r = await http.post("/v1/messages", json={**body, "stream": True})
        kinds = [line.removeprefix("event: ") for line in r.text.splitlines()
                 if line.startswith("event: ")]
        return whole, final, text, kinds

    return run_anthropic(served[0], go)


def _kind(e) -> str:
    """An API error's Anthropic type, from its body (older clients have no `type`)."""
    return e.body["error"]["type"]


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_text_with_thinking(gpt_oss_chat):
    _script(gpt_oss_chat, HARMONY_ANSWER)
    whole, final, text, kinds = _whole_and_streamed(gpt_oss_chat)
    assert _blocks(whole) == [
        {"type": "thinking", "thinking": "The user asks about weather.", "signature": ""},
        {"type": "text", "text": "It is sunny in Paris."}]
    assert whole.id.startswith("msg_") and whole.model == "tiny" and whole.role == "assistant"
    assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)
    assert _prompt_tokens(whole.usage) > 0 and whole.usage.output_tokens > 5
    assert whole.usage.cache_creation_input_tokens == 0
    assert _blocks(final) == _blocks(whole) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)
    assert text == "It is sunny in Paris."
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                    "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2


def test_stop_sequence_and_max_tokens(gpt_oss_chat):
    _script(gpt_oss_chat, HARMONY_ANSWER)
    whole, final, _, _ = _whole_and_streamed(gpt_oss_chat, stop_sequences=["sunny"])
    for m in (whole, final):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "sunny")
        assert m.content[-1].text == "It is "
    whole, final, _, _ = _whole_and_streamed(gpt_oss_chat, max_tokens=4)
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 4


def test_forced_tool_use(gpt_oss_chat):
    """tool_choice {type: tool} is a named call in Harmony's syntax: the scripted call
    passes the grammar, and comes back as a tool_use block whose input streams."""
    _script(gpt_oss_chat, HARMONY_CALL.removesuffix("<|call|>"))
    choice = {"type": "tool", "name": "get_weather"}
    whole, final, text, kinds = _whole_and_streamed(gpt_oss_chat, tools=TOOLS,
                                                    tool_choice=choice)
    assert _blocks(whole) == [
        {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert _blocks(final) == _blocks(whole) and text == ""
    assert "content_block_delta" in kinds


def test_tool_result_round_trip(gpt_oss_chat):
    """The call and its result go back as the template writes them: count_tokens, the
    answer's usage and /tokenize of the same chat all count the same prompt."""
    _script(gpt_oss_chat, HARMONY_CALL)
    history = USER + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": '{"sky": "sunny"}'}]}]}]
    chat = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"sky": "sunny"}'}]
    openai_tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in TOOLS]

    async def go(client, http):
        first = await client.messages.create(model="tiny", max_tokens=100, messages=USER,
                                             tools=TOOLS)
        _script(gpt_oss_chat, "<|channel|>final<|message|>Sunny.<|return|>")
        second = await client.messages.create(model="tiny", max_tokens=20, messages=history,
                                              tools=TOOLS)
        count = await client.messages.count_tokens(model="tiny", messages=history,
                                                   tools=TOOLS)
        tok = (await http.post("/tokenize", json={"messages": chat,
                                                  "tools": openai_tools})).json()
        prompt = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        return first, second, count.input_tokens, tok["count"], prompt["prompt"]

    first, second, count, tokenized, prompt = run_anthropic(gpt_oss_chat[0], go)
    assert first.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in first.content if b.type == "tool_use"] \
        == [("get_weather", {"city": "Paris"})]
    assert second.content[0].text == "Sunny." and second.stop_reason == "end_turn"
    assert count == tokenized == _prompt_tokens(second.usage)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>') in prompt
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"{\\"sky\\": \\"sunny\\"}"<|end|>') in prompt  # the template's tojson


def test_qwen3_thinking_text_and_parallel_calls(qwen3_chat):
    _script(qwen3_chat, QWEN_CALLS)
    whole, final, text, _ = _whole_and_streamed(qwen3_chat, tools=TOOLS)
    blocks = _blocks(whole)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert blocks[0]["thinking"].strip() == "The user wants weather."
    assert blocks[1]["text"].strip() == "Let me check."
    assert [(b["name"], b["input"]) for b in blocks[2:]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert _blocks(final) == blocks and text == blocks[1]["text"]
    one, _, _, _ = _whole_and_streamed(qwen3_chat, tools=TOOLS, tool_choice={
        "type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in one.content if b.type == "tool_use"] == ["get_weather"]


def test_qwen3_thinking_switch_and_count_tokens(qwen3_chat):
    """thinking disabled is Qwen3's enable_thinking false: the template closes an empty
    think block in the prompt."""
    async def go(client, http):
        counts = {}
        for kind in ("enabled", "disabled"):
            thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" \
                else {"type": kind}
            counts[kind] = (await client.messages.count_tokens(
                model="tiny", messages=USER, thinking=thinking, system="Be brief.")).input_tokens
        tok = (await http.post("/tokenize", json={"messages": [
            {"role": "system", "content": "Be brief."}, *USER],
            "chat_template_kwargs": {"enable_thinking": False}})).json()
        return counts, tok["count"]

    counts, tokenized = run_anthropic(qwen3_chat[0], go)
    assert counts["disabled"] == tokenized > counts["enabled"]


BAD = [  # (body, the field its 400 names)
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_result"}]}]},
     "messages.0.content.1.tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ({"max_tokens": 8, "messages": USER, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 8, "messages": USER, "top_p": 0}, "top_p"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"max_tokens": 8, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 10**6, "messages": USER}, "max_tokens"),
]


def test_bad_bodies_are_400s_in_anthropic_shape(gpt_oss_chat):
    app, aeng = gpt_oss_chat

    async def go(client, http):
        answers = [await http.post("/v1/messages", json={"model": "tiny", **body})
                   for body, _ in BAD]
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="tiny", max_tokens=8, messages=USER,
                                         stop_sequences=[""])
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="claude-other", max_tokens=8, messages=USER)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="claude-other", messages=USER)
        return answers, bad.value, missing.value

    answers, bad, missing = run_anthropic(app, go)
    for (body, field), r in zip(BAD, answers):
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(field + ":"), (field, err)
    assert bad.status_code == 400 and _kind(bad) == "invalid_request_error"
    assert "stop_sequences:" in bad.message
    assert missing.status_code == 404 and _kind(missing) == "not_found_error"
    assert aeng.num_queued == 0


def test_live_server_with_x_api_key(tiny_with_tokenizer):
    """On a real server: the key as x-api-key (Anthropic's client) or a bearer token; a
    wrong one is a 401 in each surface's own shape."""
    base, proc = start_server("--model", tiny_with_tokenizer, "--dtype", "float32",
                              "--served-model-name", "tiny", "--api-key", "sekret",
                              "--max-model-len", "512", timeout=120)
    try:
        client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)
        greedy = {"extra_body": {"temperature": 0}}  # newer clients have no temperature
        m = client.messages.create(model="tiny", max_tokens=4, messages=USER, **greedy)
        assert 0 < m.usage.output_tokens <= 4 and m.stop_reason in ("max_tokens", "end_turn")
        with client.messages.stream(model="tiny", max_tokens=4, messages=USER,
                                    **greedy) as s:
            assert s.get_final_message().content[0].text == m.content[0].text
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=USER)
        assert e.value.status_code == 401 and _kind(e.value) == "authentication_error"
        openai_401 = httpx.post(base + "/v1/completions", json={"prompt": "x"},
                                headers={"x-api-key": "wrong"}, timeout=30)
        assert openai_401.status_code == 401
        assert openai_401.json()["error"]["type"] == "authentication_error"
        bearer = httpx.post(base + "/v1/messages/count_tokens",
                            json={"model": "tiny", "messages": USER},
                            headers={"authorization": "Bearer sekret"}, timeout=30)
        assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
        assert json.loads(m.model_dump_json())["type"] == "message"
    finally:
        stop_server(proc)


def test_engine_failure_mid_stream_is_an_error_event(gpt_oss_chat):
    """A request that fails inside the engine after its stream began ends with Anthropic's
    error event, which the client raises."""
    app, aeng = gpt_oss_chat
    _script(gpt_oss_chat, HARMONY_ANSWER)
    output = aeng.engine.output
    scripted = output.accept

    def failing(req, tok, logprobs, now=None):
        if len(req.output_token_ids) == 6:
            raise RuntimeError("a broken detokenizer")
        scripted(req, tok, logprobs, now)

    output.accept = failing
    body = {"model": "tiny", "max_tokens": 50, "messages": USER}

    async def go(client, http):
        r = await http.post("/v1/messages", json={**body, "stream": True})
        with pytest.raises(anthropic.APIStatusError) as e:
            async with client.messages.stream(**body) as s:
                await s.get_final_message()
        return r.text, e.value

    try:
        text, raised = run_anthropic(app, go)
    finally:
        output.accept = scripted
    lines = text.splitlines()
    assert lines[0] == "event: message_start" and "event: message_stop" not in lines
    at = lines.index("event: error")
    error = json.loads(lines[at + 1].removeprefix("data: "))
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert _kind(raised) == error["error"]["type"]


def test_error_types_follow_anthropic_statuses():
    """The server's 503 (full, or its engine gone) is Anthropic's 529 overloaded_error; the
    rest keep their status under Anthropic's type names."""
    from swaserve.server.anthropic.answer import error_body, error_status
    from swaserve.server.errors import APIError

    cases = [(400, 400, "invalid_request_error"), (401, 401, "authentication_error"),
             (404, 404, "not_found_error"), (413, 413, "request_too_large"),
             (503, 529, "overloaded_error"), (504, 504, "timeout_error"),
             (500, 500, "api_error")]
    for status, shown, kind in cases:
        e = APIError(status, "why")
        assert error_status(e) == shown
        assert error_body(e) == {"type": "error", "error": {"type": kind, "message": "why"}}
