"""The server under what production traffic brings, on a tiny model with a real tokenizer
(a real uvicorn process on loopback, or the app in process): fuzzed and malformed bodies,
clients that disconnect, bursts past the waiting limit, huge prompts, deadlines, shutdown.
Every loop here is bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import struct
import threading
import time

import httpx
import pytest

from tests.conftest import TEST_DEVICE, asgi_client, start_server, stop_server
from tests.server.conftest import BAD, ODD_BUT_FINE

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(base: str, timeout: float = 20.0) -> float:
    """Seconds until the gauges say idle (running = waiting = 0, no row or request page in
    use), without sending any request but /metrics."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (metric(base, "swaserve_requests_running") == 0
                and metric(base, "swaserve_requests_waiting") == 0
                and metric(base, "swaserve_ring_rows_usage") == 0
                and metric(base, "swaserve_full_pool_request_pages") == 0):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"not idle after {timeout} s")


def sse_events(lines) -> list:
    """The JSON events of a stream and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        events.append(json.loads(line[6:]))
    return events, done


@pytest.fixture(scope="module")
def server(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--api-key", KEY, "--max-running-requests", "48",
                              "--kv-memory", "64MiB", "--max-waiting", "512",
                              "--max-model-len", "4096")
    yield base
    stop_server(proc)


# -- bad input beside a stream -------------------------------------------------------------
def test_bad_input_beside_a_stream_leaves_it_untouched(server):
    """The field-by-field 400s are in test_server_inprocess.py; here a real stream runs
    while malformed requests arrive, and it produces exactly what it produces alone."""
    body = {"prompt": "A long story:", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}

    def stream_text() -> tuple[str, list]:
        with httpx.stream("POST", server + "/v1/completions", headers=AUTH, json=body,
                          timeout=120) as r:
            events, done = sse_events(r.iter_lines())
        assert done
        return "".join(e["choices"][0]["text"] for e in events), events

    alone, _ = stream_text()
    result = {}
    t = threading.Thread(target=lambda: result.update(zip(("text", "events"), stream_text())))
    t.start()
    time.sleep(0.2)
    for route, bad, _ in BAD:
        r = httpx.post(f"{server}/v1/{route}", headers=AUTH, json=bad, timeout=60)
        assert r.status_code == 400, (bad, r.text)
    for route, odd in ODD_BUT_FINE:
        assert httpx.post(f"{server}/v1/{route}", headers=AUTH, json=odd,
                          timeout=60).status_code == 200
    t.join(120)
    assert result["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert result["text"] == alone  # exactly what it produced alone


def test_request_body_limit_is_a_413(tiny_with_tokenizer):
    base, proc = start_server("--model", tiny_with_tokenizer, "--dtype", "float32",
                              "--max-request-bytes", "10000")
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": "x" * 20000}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: counted as it arrives
            for _ in range(20):
                yield b" " * 1000
        r = httpx.post(base + "/v1/completions", content=chunked(), timeout=30)
        assert r.status_code == 413
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
        assert metric(base, 'swaserve_requests_rejected_total{reason="too_large"}') == 2
    finally:
        stop_server(proc)


def test_auth_covers_every_route_but_health(tiny_with_tokenizer):
    base, proc = start_server("--model", tiny_with_tokenizer, "--dtype", "float32",
                              "--api-key", KEY, "--public-path", "/metrics")
    try:
        assert httpx.get(base + "/health").status_code == 200
        for path in ("/v1/models", "/openapi.json", "/v1/../v1/models", "/V1/models", "/nope"):
            r = httpx.get(base + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(base + "/openapi.json", headers=AUTH).status_code == 200
        assert httpx.get(base + "/metrics").status_code == 200  # opened by --public-path
    finally:
        stop_server(proc)


# -- disconnects -------------------------------------------------------------------------
async def _client(base: str, i: int, mode: str) -> str:
    body = {"prompt": f"Story {i}:", "max_tokens": 40 + i % 30, "temperature": 0.8, "seed": i,
            "stream": True, "ignore_eos": True}
    if mode == "stay":
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", base + "/v1/completions", headers=AUTH, json=body) as r:
                events, done = sse_events([line async for line in r.aiter_lines()])
        assert done and events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]
        return "finished"
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    chunks = 0
    while chunks < 1 + i % 3:  # leave after 1-3 chunks
        line = await asyncio.wait_for(reader.readline(), 60)
        assert line, "the server closed the stream first"
        chunks += line.startswith(b"data: ")
    sock = writer.get_extra_info("socket")
    if mode == "reset":  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    return "left"


def test_128_streams_a_third_disconnecting_abruptly(server):
    modes = ["stay", "close", "stay", "reset", "stay", "stay"] * 22
    modes = modes[:128]

    async def run():
        return await asyncio.gather(*[_client(server, i, m) for i, m in enumerate(modes)])

    t0 = time.monotonic()
    outcome = asyncio.run(asyncio.wait_for(run(), 240))
    assert outcome.count("finished") == modes.count("stay") and outcome.count("left") >= 40
    idle = wait_idle(server)  # the gauges return to idle with no further request
    assert time.monotonic() - t0 < 240 and idle < 20
    assert metric(server, "swaserve_requests_aborted_total") >= 40


def test_a_non_streaming_request_whose_client_left_stops(server):
    before = metric(server, "swaserve_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers=AUTH, timeout=1.0,
                   json={"prompt": "Go on:", "max_tokens": 4000, "ignore_eos": True})
    wait_idle(server, 10)
    made = metric(server, "swaserve_generation_tokens_total") - before
    time.sleep(0.5)
    assert metric(server, "swaserve_generation_tokens_total") - before == made < 4000


# -- overload, huge prompts, deadlines ---------------------------------------------------
def test_a_burst_past_the_waiting_limit_gets_503_for_the_excess_only(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--max-running-requests", "2", "--max-waiting", "8",
                              "--max-model-len", "2048")
    try:
        async def one(c, i):
            r = await c.post(base + "/v1/completions", json={
                "prompt": f"n{i}", "max_tokens": 200, "ignore_eos": True})
            return r.status_code, r.headers.get("retry-after"), r.json()

        async def burst():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(
                    max_connections=64)) as c:
                return await asyncio.gather(*[one(c, i) for i in range(48)])
        res = asyncio.run(burst())
        codes = [r[0] for r in res]
        assert set(codes) <= {200, 503}, codes
        assert codes.count(200) >= 8 and codes.count(503) >= 1
        for code, retry, body in res:
            if code == 503:
                assert retry == "1" and body["error"]["code"] == "overloaded"
            else:
                assert body["choices"][0]["finish_reason"] == "length"
        assert metric(base, 'swaserve_requests_rejected_total{reason="overloaded"}') == codes.count(503)
    finally:
        stop_server(proc)


def test_health_answers_fast_while_huge_prompts_are_processed(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--max-model-len", "32768")
    try:
        # 190k characters (420 kB) of byte-level tokens: within the characters 32768 tokens
        # can cover, so tokenized whole (0.1-0.2 s each), more tokens than the context
        # holds; 8 times that (3.4 MB) is refused untokenized (server/bounds.py).
        # The bodies are encoded here, before polling: json.dumps of 3.4 MB holds this
        # process's GIL for ~30 ms, which the polls would count
        words = ("漢字かな🙂é ab " * 40_000)[:190_000]
        bodies = [(path, json.dumps(body).encode()) for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}),
            ("/v1/completions", {"prompt": words}),
            ("/v1/completions", {"prompt": words * 8})]]
        stop = threading.Event()

        def huge():
            with httpx.Client(timeout=120, headers={"content-type": "application/json"}) as c:
                for _ in range(4):
                    codes = [c.post(base + path, content=body).json()["error"]["code"]
                             for path, body in bodies]
                    assert codes == ["context_length_exceeded"] * 3, codes
            stop.set()

        t = threading.Thread(target=huge)
        t.start()
        took = []
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(base + "/health").status_code == 200
                took.append(time.perf_counter() - t0)
                time.sleep(0.02)
        t.join()
        # a loop blocked by the tokenizer holds a poll at each of the eight prompts it
        # tokenizes whole (0.15-0.2 s each). The server parses each 3.4 MB body on its loop
        # (json + pydantic, 15-25 ms alone), and a shared machine stalls a few polls past
        # 100 ms (CI once saw 103, 119 and 134 ms): up to four slow polls pass
        slow = [round(s, 3) for s in took if s >= 0.1]
        assert len(took) >= 10 and len(slow) <= 4, f"/health took {slow} s"
        assert max(took) < 1.0, f"/health took {max(took):.2f} s"
    finally:
        stop_server(proc)


def test_request_timeout_ends_a_request_with_an_error(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--request-timeout", "0.5", "--max-model-len", "16384")
    try:
        body = {"prompt": "x", "max_tokens": 16000, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            events, done = sse_events(r.iter_lines())
        assert done and events[-1]["error"]["code"] == "request_timeout"
        assert metric(base, "swaserve_requests_timed_out_total") == 2
        wait_idle(base, 10)
    finally:
        stop_server(proc)


def test_sigterm_ends_every_stream_with_a_final_event(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--shutdown-timeout", "1", "--max-model-len", "16384")
    results: list = []

    started = [threading.Event() for _ in range(4)]

    def stream(i: int):
        body = {"prompt": f"s{i}", "max_tokens": 30 if i == 0 else 16000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            started[i].set()  # its first event is on the way: it runs in the engine
            results.append(sse_events(r.iter_lines()))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for e in started:  # a fixed sleep let a slow machine signal before a stream began
        assert e.wait(30)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    out = stop_server(proc)
    assert len(results) == 4
    for events, done in results:
        assert done  # every stream got its [DONE] ...
        last = events[-1]  # ... after a finish_reason or an error event
        assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
    assert sum("error" in ev[-1] for ev, _ in results) == 3  # the short one finished
    assert "Traceback" not in out


# -- the engine thread dies ----------------------------------------------------------------
def test_a_dead_engine_thread_is_unhealthy_and_fails_clients(tiny_with_tokenizer):
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, kv_memory="16MiB")

    def broken_step():
        raise RuntimeError("the pools are corrupt")
    eng.step = broken_step
    aeng = AsyncEngine(eng)
    app = create_app(aeng, "tiny")

    async def run():
        async with asgi_client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and "corrupt" in r.json()["error"]["message"]
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    asyncio.run(asyncio.wait_for(run(), 30))
    aeng.shutdown()


# -- fuzzing -----------------------------------------------------------------------------
def test_random_bodies_never_get_a_5xx(server):
    """Mutations of valid bodies (fields dropped, retyped, out of range, nested wrong),
    bounded; the schema-driven fuzz is in test_fuzz.py."""
    rng = random.Random(0)
    base_bodies = [("completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0.5,
                                    "logprobs": 2, "stop": ["x"], "n": 2, "seed": 3}),
                   ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                         "response_format": {"type": "json_object"}})]
    junk = [None, True, -1, 0, 2**64, 1e308, -1e-300, "", "\x00", "é" * 50, [], {}, [None],
            {"type": None}, [[1, 2]], "hi"]
    with httpx.Client(timeout=60) as c:
        for _ in range(150):
            route, body = rng.choice(base_bodies)
            body = json.loads(json.dumps(body))
            for _ in range(rng.randint(1, 3)):
                key = rng.choice(list(body) + ["top_k", "min_p", "logit_bias", "echo",
                                               "min_tokens", "stop_token_ids", "regex"])
                if rng.random() < 0.2:
                    body.pop(key, None)
                else:
                    body[key] = rng.choice(junk)
            r = c.post(f"{server}/v1/{route}", headers=AUTH, json=body)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
