"""One request must not be able to kill or stall the server: pathological texts up to the
body limit on every route that tokenizes (each answered in at most 2 s, the process's
memory bounded), JSON nested as deep as the body parser accepts, a streaming client that
leaves before its first token, the waiting gauge after a refusal, the bearer scheme in any
case, and the refusals the reference APIs make. In process, on a tiny model with a real
byte-level BPE tokenizer; every loop is bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import threading
import time

import psutil
import pytest

from swaserve.server.app import DEFAULT_MAX_REQUEST_BYTES
from swaserve.server.guard import Guard
from swaserve.server.openai.protocol import ChatCompletionRequest
from swaserve.server.responses.protocol import ResponsesRequest
from tests.conftest import asgi_client, inprocess_served

MAX_SECONDS = 2.0  # an answer, whatever the text
MAX_GROWTH = 768 * 2**20  # the process's peak memory over its start: the bodies' copies


@pytest.fixture(scope="module")
def served(tiny_long_context):
    yield from inprocess_served(tiny_long_context, kv_memory="64MiB", max_model_len=4096)


def _user(s: str) -> list[dict]:
    return [{"role": "user", "content": s}]


ROUTES = {  # route -> body of a text
    "/v1/completions": lambda s: {"prompt": s, "max_tokens": 1},
    "/v1/chat/completions": lambda s: {"messages": _user(s), "max_tokens": 1},
    "/v1/responses": lambda s: {"input": s, "max_output_tokens": 1},
    "/v1/messages": lambda s: {"model": "tiny", "max_tokens": 1, "messages": _user(s)},
    "/v1/messages/count_tokens": lambda s: {"model": "tiny", "messages": _user(s)},
    "/tokenize": lambda s: {"prompt": s},
    "/tokenize#messages": lambda s: {"messages": _user(s)},
    "/v1/embeddings": lambda s: {"input": s},
}
_NO_SPACE = string.ascii_letters + string.digits + string.punctuation
KINDS = [" ", "-", "=", ".", "a", "\n", "字", "🙂", "no-space"] + list(string.punctuation)


def _text(kind: str, chars: int) -> str:
    if kind == "no-space":
        return "".join(random.Random(0).choices(_NO_SPACE, k=chars))
    return kind * chars


def _body(route: str, kind: str, size: int) -> bytes:
    """The route's body of a text of `kind`, about `size` bytes of JSON (never more)."""
    per_char = len(json.dumps(_text(kind, 64), ensure_ascii=False).encode()) / 64
    chars = int((size - 200) / per_char)
    return json.dumps(ROUTES[route](_text(kind, chars)), ensure_ascii=False).encode()


class PeakMemory:
    """The process's peak resident memory over its start, sampled every few milliseconds."""

    def __init__(self):
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _post_all(app, bodies: list[tuple[str, bytes]]) -> list[tuple[str, int, float, str]]:
    """Each body posted in turn: (route, status, seconds, the answer's start)."""

    async def run():
        out = []
        async with asgi_client(app, timeout=120) as c:
            for route, body in bodies:
                t0 = time.perf_counter()
                r = await c.post(route.split("#")[0], content=body,
                                 headers={"content-type": "application/json"})
                out.append((route, r.status_code, time.perf_counter() - t0, r.text[:4000]))
        return out
    return asyncio.run(run())


def _check_answers(answers) -> None:
    slowest = max(answers, key=lambda a: a[2])
    print(f"{len(answers)} answers, the slowest {slowest[2]:.3f} s ({slowest[0]})")
    for route, status, seconds, text in answers:
        assert status in (200, 400), (route, status, text)
        assert seconds <= MAX_SECONDS, (route, f"{seconds:.2f} s", text)


def test_texts_at_the_body_limit_are_answered_fast_on_every_route(served):
    """A text as long as the body limit allows, of the kinds that make a tokenizer slow
    (a run of one character is one pre-tokenizer word): refused before tokenizing."""
    app, _ = served
    for kind in [" ", "-", "字", "no-space"]:
        with PeakMemory() as mem:
            answers = _post_all(app, [(route, _body(route, kind, DEFAULT_MAX_REQUEST_BYTES))
                                      for route in ROUTES])
        _check_answers(answers)
        assert all(status == 400 for _, status, _, _ in answers), answers
        print(f"{kind!r}: peak memory +{mem.growth / 2**20:.0f} MiB")
        assert mem.growth < MAX_GROWTH, (kind, mem.growth / 2**20)


def test_texts_at_the_character_bound_are_tokenized_fast(served):
    """Texts just inside the bound (the longest token times the context), which are
    tokenized: each kind of run, a multi-byte character, no whitespace at all."""
    app, aeng = served
    limit = aeng.engine.tokenizer.longest_token * aeng.engine.max_model_len
    bodies = [(route, json.dumps(ROUTES[route](_text(kind, limit)), ensure_ascii=False).encode())
              for kind in KINDS for route in ROUTES]
    with PeakMemory() as mem:
        answers = _post_all(app, bodies)
    _check_answers(answers)
    print(f"peak memory +{mem.growth / 2**20:.0f} MiB")
    assert mem.growth < MAX_GROWTH, mem.growth / 2**20
    over = _post_all(app, [("/v1/completions", json.dumps(
        ROUTES["/v1/completions"]("-" * (limit + 1))).encode())])
    assert over[0][1] == 400 and f"prompt: {limit + 1} characters" in over[0][3], over


def test_many_embedding_inputs_are_bounded(served):
    app, _ = served
    answers = _post_all(app, [("/v1/embeddings", json.dumps({"input": ["a"] * 2049}).encode()),
                              ("/v1/embeddings", json.dumps(
                                  {"input": ["-" * 10_000] * 2048}).encode())])
    _check_answers(answers)
    assert [status for _, status, _, _ in answers] == [400, 400], answers


# -- JSON nested as deep as the body parser accepts ----------------------------------------
def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


DEEP_FIELDS = {  # (route, body of a nested value)
    "chat kwargs": ("/v1/chat/completions", lambda v: {"messages": _user("x"), "max_tokens": 1,
                                                        "chat_template_kwargs": {"x": v}}),
    "tokenize kwargs": ("/tokenize", lambda v: {"messages": _user("x"),
                                                "chat_template_kwargs": {"x": v}}),
    "responses kwargs": ("/v1/responses", lambda v: {"input": "x", "max_output_tokens": 1,
                                                     "chat_template_kwargs": {"x": v}}),
    "responses tool": ("/v1/responses", lambda v: {"input": "x", "max_output_tokens": 1, "tools": [
        {"type": "function", "name": "f", "parameters": {"x": v}}]}),
    "chat tool": ("/v1/chat/completions", lambda v: {"messages": _user("x"), "max_tokens": 1,
                                                     "tools": [{"type": "function", "function": {
                                                         "name": "f", "parameters": {"x": v}}}]}),
    "messages tool": ("/v1/messages", lambda v: {"model": "tiny", "max_tokens": 1,
                                                 "messages": _user("x"),
                                                 "tools": [{"name": "f", "input_schema": v}]}),
}


def test_nested_values_are_refused_without_recursion():
    """Validation walks a free-form field without recursing: a value far deeper than any
    body parser accepts is a validation error, never a RecursionError."""
    deep = _nested(5 * sys.getrecursionlimit())
    for model, body in [(ChatCompletionRequest, {"messages": _user("x"),
                                                 "chat_template_kwargs": {"x": deep}}),
                        (ResponsesRequest, {"input": "x", "text": {"format": {
                            "type": "json_schema", "schema": deep}}})]:
        with pytest.raises(ValueError, match="nests deeper than"):
            model.model_validate(body)


def test_json_as_deep_as_the_parser_accepts_is_a_400(served):
    """At every depth up to the parser's own limit (found here), a 400 in the surface's
    shape naming the field."""
    app, _ = served

    async def post(c, route, body) -> tuple[int, dict]:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit * 4)  # this side's json.dumps recurses
        try:
            data = json.dumps(body)
        finally:
            sys.setrecursionlimit(limit)
        r = await c.post(route, content=data, headers={"content-type": "application/json"})
        return r.status_code, r.json()

    async def run():
        async with asgi_client(app) as c:
            for name, (route, make) in DEEP_FIELDS.items():
                lo, hi = 100, 2 * sys.getrecursionlimit()  # lo is parsed, hi is not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    _, body = await post(c, route, make(_nested(mid)))
                    parsed = "parsing the body" not in json.dumps(body)
                    lo, hi = (mid, hi) if parsed else (lo, mid)
                for depth in [*range(lo, lo - 12, -1), 300, 130]:
                    status, body = await post(c, route, make(_nested(depth)))
                    assert status == 400, (name, depth, body)
                    err = body["error"]
                    assert "nests" in err["message"], (name, depth, err)
                    if not route.startswith("/v1/messages"):
                        assert err["param"] and err["message"].startswith(err["param"])
    asyncio.run(run())


# -- a stream's client leaving before its first token, the waiting gauge -------------------
def _metric(app, name: str) -> float:
    async def get():
        async with asgi_client(app) as c:
            return (await c.get("/metrics")).text
    for line in asyncio.run(get()).splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _leave_at_once(app, path: str, body: bytes) -> list[dict]:
    """What the app sends a client that sends `body` and leaves at once."""
    sent: list[dict] = []
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}  # the client has gone

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("t", 80),
             "client": ("c", 1), "http_version": "1.1", "asgi": {"version": "3.0"},
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), 60)
    return sent


def test_a_stream_whose_client_leaves_before_its_first_token_is_not_prefilled(
        tiny_long_context):
    """The client sends a long prompt and leaves at once: the request is aborted while it
    prefills, so no first token is ever made (its prompt is never counted)."""
    for app, aeng in inprocess_served(tiny_long_context, kv_memory="64MiB",
                                      max_model_len=32768):
        body = json.dumps({"prompt": list(range(3, 120)) * 250, "max_tokens": 4,
                           "stream": True}).encode()
        t0 = time.monotonic()
        sent = asyncio.run(_leave_at_once(app, "/v1/completions", body))
        assert sent[0]["status"] == 499, sent[:1]
        while aeng.engine.has_unfinished() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        assert _metric(app, "swaserve_requests_aborted_total") == 1
        assert _metric(app, "swaserve_prompt_tokens_total") == 0  # no first token came


def test_the_waiting_gauge_drops_when_an_admission_is_handed_back(served):
    """An admission held while the engine thread refreshes its gauges (another request
    runs), then handed back on the event loop (its prompt refused): waiting is 0 again."""
    app, aeng = served
    aeng.admit()
    try:
        answers = _post_all(app, [("/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 2}).encode())])
        assert answers[0][1] == 200, answers
        time.sleep(0.2)  # the engine thread's last refresh, with the admission counted
    finally:
        aeng.cancel_admission()
    assert _metric(app, "swaserve_requests_waiting") == 0


# -- the bearer scheme, the reference APIs' refusals ---------------------------------------
def test_the_bearer_scheme_is_case_insensitive():
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = Guard(ok, api_key="sesame", max_body_bytes=1024)

    async def status(auth: bytes) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg):
            sent.append(msg)
        await guard({"type": "http", "method": "GET", "path": "/v1/models",
                     "headers": [(b"authorization", auth)]}, receive, send)
        return sent[0]["status"]

    codes = {auth: asyncio.run(status(auth)) for auth in [
        b"Bearer sesame", b"bearer sesame", b"BEARER sesame", b"Bearer  sesame ",
        b"bearer wrong", b"Basic sesame", b"sesame", b"bearersesame"]}
    assert list(codes.values()) == [200, 200, 200, 200, 401, 401, 401, 401], codes


REFUSED = [  # (route, body, field named)
    ("/v1/responses", {"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ("/v1/responses", {"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ("/v1/responses", {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
     "metadata"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": _user("")},
     "messages.0.content"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": []}]}, "messages.0.content"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        *_user("x"), {"role": "assistant", "content": ""}, *_user("y")]}, "messages.1.content"),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": _user("")},
     "messages.0.content"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": _user("x"),
                      "thinking": {"type": "enabled", "budget_tokens": 4}},
     "thinking.budget_tokens"),
]


def test_what_the_reference_apis_refuse_is_a_400_naming_the_field(served):
    app, _ = served
    answers = _post_all(app, [(route, json.dumps(body).encode()) for route, body, _ in REFUSED])
    for (route, body, field), (_, status, _, text) in zip(REFUSED, answers):
        assert status == 400, (body, text)
        err = json.loads(text)["error"]
        assert err["message"].startswith(field), (body, err)
        if route.startswith("/v1/messages"):
            assert set(err) == {"type", "message"}, err
        else:
            assert err["param"] == field, err
    fine = _post_all(app, [("/v1/messages", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [
            *_user("x"), {"role": "assistant", "content": ""}]}).encode())])
    assert fine[0][1] == 200, fine  # a final assistant message may be empty (a prefill)
