"""The server's request handling in process (httpx's ASGI transport, a tiny model with a
real tokenizer): every malformed body is a 400 naming its field, odd but valid ones are
served, and the basics of both routes work. Milliseconds a request; the behaviour that
needs a real socket (disconnects, signals, bursts) is in test_server_resilience.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.conftest import asgi_client, inprocess_app
from tests.server.conftest import BAD, ODD_BUT_FINE


@pytest.fixture(scope="module")
def app(tiny_with_tokenizer):
    yield from inprocess_app(tiny_with_tokenizer, kv_memory="16MiB", max_running_requests=24,
                             max_model_len=256)


def call(app, requests: list[tuple[str, object]]) -> list[httpx.Response]:
    async def run():
        async with asgi_client(app) as c:
            return await asyncio.gather(*[
                c.post(f"/v1/{route}", content=body.encode(),
                       headers={"content-type": "application/json"})
                if isinstance(body, str) else c.post(f"/v1/{route}", json=body)
                for route, body in requests])
    return asyncio.run(run())


def test_every_malformed_body_is_a_400_naming_its_field(app):
    for (_, body, param), r in zip(BAD, call(app, [(r, b) for r, b, _ in BAD])):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error" and err["message"].startswith(param)


def test_odd_but_valid_bodies_are_served_in_strict_json(app):
    for (_, body), r in zip(ODD_BUT_FINE, call(app, ODD_BUT_FINE)):
        assert r.status_code == 200, (body, r.text)
        json.dumps(r.json(), allow_nan=False)  # strict JSON: no NaN or Infinity in logprobs


def test_bodies_that_are_not_json_objects(app):
    raw = [("completions", '{"prompt": "\\ud800", "max_tokens": 2}'),
           ("completions", '{"prompt": "abc", "max_tokens": 2,,}'),
           ("completions", "[1, 2]")]
    why = ["lone surrogate", "not valid JSON", "request body"]
    for w, r in zip(why, call(app, raw)):
        assert r.status_code == 400 and w in r.json()["error"]["message"], r.text
    assert call(app, raw[1:2])[0].json()["error"]["param"] is None


def test_stream_lines_split_only_at_event_ends(app):
    """Text may hold characters that many line readers take for line breaks (U+0085,
    U+2028, U+2029: Python's str.splitlines and httpx's iter_lines do): the server writes
    them escaped, so every event is one line to any reader and decodes to the same text.
    A random-weight model's long stream once held one, and the client's JSON was cut at
    the start of its text."""
    text = "a\x85b\u2028c\u2029d\x1ce\x1df\x1eg\x0bh\x0ci\rj\nk"  # all splitlines splits at
    assert len(text.splitlines()) == 11
    r = call(app, [("completions", {"prompt": text, "echo": True, "max_tokens": 1,
                                    "stream": True})])[0]
    lines = [line for line in r.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events).startswith(text)


def test_both_routes_stream_and_not(app):
    done = call(app, [("completions", {"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                       "ignore_eos": True}),
                      ("completions", {"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                       "ignore_eos": True, "stream": True,
                                       "stream_options": {"include_usage": True}}),
                      ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 5, "n": 2, "stream": True})])
    whole = done[0].json()["choices"][0]
    assert whole["finish_reason"] == "length"
    events = [json.loads(line[6:]) for line in done[1].text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole["text"]
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert done[1].text.rstrip().endswith("data: [DONE]")
    chat = [json.loads(line[6:]) for line in done[2].text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
    assert {c["choices"][0]["index"] for c in chat} == {0, 1}
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
