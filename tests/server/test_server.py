"""The real server (uvicorn on 127.0.0.1, free port) driven by the official openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow
KEY = "test-key"
MODEL = "gemma-3-270m-q4_k_m"


def _start(*extra: str):
    return start_server("--api-key", KEY, "--max-running-requests", "40",
                        "--max-model-len", "2048", "--max-waiting", "64", *extra)


def _stop(proc) -> None:
    stop_server(proc)


@pytest.fixture(scope="module")
def server():
    base, proc = _start()
    yield base, proc
    _stop(proc)


@pytest.fixture(scope="module")
def server_invariant():
    """--batch-invariant: CPU GEMM kernels change with the number of rows (above 32 here),
    which moves a bf16 row's logits by ~0.3 when its batch grows, enough to flip a near-tie;
    this mode gives a request the same bits whatever runs beside it."""
    base, proc = _start("--batch-invariant")
    yield base, proc
    _stop(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _metric(base: str, name: str) -> float:
    r = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_completion_greedy_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == 6  # <bos> + 5, as the tokenizer counts
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_streaming_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                     temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert text == r.choices[0].message.content


def test_n2_stop_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="List: one, two,", max_tokens=12, n=2,
                                  temperature=1.0, seed=7)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    again = client.completions.create(model=MODEL, prompt="List: one, two,", max_tokens=12, n=2,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 7"])
    assert " 7" not in s.choices[0].text and s.choices[0].finish_reason == "stop"


def _seed_alone_and_under_load(base: str) -> tuple[str, str]:
    async def run():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        alone = await c.completions.create(model=MODEL, prompt="In the forest", max_tokens=16,
                                           temperature=0.9, top_p=0.95, seed=1234)
        others = [c.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=24,
                                       temperature=1.0) for i in range(8)]
        mine = c.completions.create(model=MODEL, prompt="In the forest", max_tokens=16,
                                    temperature=0.9, top_p=0.95, seed=1234)
        res = await asyncio.gather(mine, *others)
        return alone.choices[0].text, res[0].choices[0].text
    return asyncio.run(run())


@pytest.mark.xfail(strict=False, reason="by default bf16 GEMM kernels are not batch-invariant "
                   "on CPU: the sampler's seeded noise is, but a row's logits shift by round-off "
                   "with the batch size; --batch-invariant (next test) removes that")
def test_seed_reproducible_under_concurrent_load(server):
    a, b = _seed_alone_and_under_load(server[0])
    assert a == b


def test_seed_reproducible_under_concurrent_load_batch_invariant(server_invariant):
    a, b = _seed_alone_and_under_load(server_invariant[0])
    assert a == b


def test_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    for item in c.choices[0].logprobs.content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2


def test_errors_in_openai_shape(client, server):
    base = server[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"top_k": -5})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"{not json")
    assert r.status_code == 400 and "Traceback" not in r.text and "error" in r.json()
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(base + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_memory(server):
    base = server[0]
    with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(base, "swaserve_requests_running") > 0:
        time.sleep(0.2)
        httpx.get(base + "/health")
    # a request after the abort still works, and the pools are empty once it ends
    openai.OpenAI(base_url=base + "/v1", api_key=KEY).completions.create(
        model=MODEL, prompt="ok", max_tokens=2)
    time.sleep(0.3)
    assert _metric(base, "swaserve_requests_running") == 0
    assert _metric(base, "swaserve_ring_rows_usage") == 0  # every row (and its pages) returned
    assert _metric(base, "swaserve_full_pool_request_pages") == 0  # what is left is cache


@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
def test_32_concurrent_streaming_clients(request, mode):
    server = request.getfixturevalue("server" if mode == "default" else "server_invariant")
    async def one(c, i):
        s = await c.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=16,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
        chunks = [ch async for ch in s]
        assert chunks[-1].usage.completion_tokens == 16  # every stream ran to its end
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    async def run():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
        together = await asyncio.gather(*[one(c, i) for i in range(32)])
        alone = [await one(c, i) for i in (0, 17, 31)]
        return together, alone
    together, alone = asyncio.run(run())
    assert all(t for t in together)
    if mode == "batch_invariant":  # by default a crowd may flip a near-tie (see above)
        assert [together[0], together[17], together[31]] == alone


def test_structured_output(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
        "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The largest city of France as JSON"}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    import json

    import jsonschema

    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.8,
                                  seed=3, extra_body={"regex": r" [0-9]{3}-[0-9]{4}"})
    import re

    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet? Answer."}], max_tokens=5,
        temperature=0, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt='Example: {"animal": "dog", "legs": 4}\n'
                                  'Another one, a cat: ', max_tokens=128, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_bad_grammars_are_400_before_queueing(client):
    cases = [({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
              "response_format"),
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"regex": "a(b"}, "regex"),
             ({"ebnf": "root ::= ("}, "grammar"),
             ({"regex": "a", "guided_json": {"type": "object"}}, "regex")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.choices[0].text is not None


def test_tool_calls_on_the_real_model(client):
    """A named and a required call (sync and streamed) on the bundled model: the arguments
    parse and validate against the function's schema; a second turn takes the result."""
    import json

    import jsonschema

    weather = {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather,
                                               "description": "current weather in a city"}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=ask, tools=tools,
                                           tool_choice=choice, temperature=0, max_tokens=100)
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather)
        args, finish = "", None
        for ev in client.chat.completions.create(model=MODEL, messages=ask, tools=tools,
                                                 tool_choice=choice, temperature=0,
                                                 max_tokens=100, stream=True):
            for ch in ev.choices:
                finish = ch.finish_reason or finish
                for t in ch.delta.tool_calls or []:
                    args += t.function.arguments or ""
        assert finish == "tool_calls" and args == call.function.arguments
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=tools,
                                       tool_choice="none", temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 20
