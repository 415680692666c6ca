"""Data-parallel replicas without Ray: the routing policy (swaserve/ray/routing.py), the
forwarded request through a replica's app (forward.py), a replica's engine config. The
Ray Serve application itself is tested on the bundled model in test_data_parallel.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from swaserve.config import EngineConfig
from swaserve.ray.forward import ForwardedRequest, ResponseStart, call_asgi
from swaserve.ray.routing import (
    BLOCK_CHARS,
    PrefixIndex,
    choose,
    prefix_blocks,
    prompt_text,
    request_blocks,
)
from swaserve.server.factory import ServerOptions
from tests.conftest import asgi_client, inprocess_served


def test_prompt_text_of_every_body_shape():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    text = prompt_text(chat)
    assert text.startswith("<system>be brief\n<user>") and '"hi"' in text
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [5, 6, 7]}) == "5 6 7"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [[1, 2], [3]]}) == "1 2"
    for body in ({}, {"prompt": []}, {"prompt": 5}, {"messages": "x"}):
        assert prompt_text(body) is None


def test_prefix_blocks_are_chained_and_leave_the_partial_block_out():
    a = "x" * (3 * BLOCK_CHARS) + "tail"
    b = "x" * (2 * BLOCK_CHARS) + "y" * BLOCK_CHARS
    ha, hb = prefix_blocks(a), prefix_blocks(b)
    assert len(ha) == len(hb) == 3
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # a difference in block 0 changes every later hash (the chain), not only block 0's
    c = "z" + a[1:]
    assert all(x != y for x, y in zip(prefix_blocks(c), ha))
    assert prefix_blocks("short") == []
    assert len(prefix_blocks("q" * BLOCK_CHARS * 10, max_blocks=4)) == 4


def test_prefix_blocks_are_the_same_in_every_process():
    """Ingress replicas each hash on their own: Python's salted hash() would not agree."""
    text = "conversation " * 40
    code = ("from swaserve.ray.routing import prefix_blocks; "
            f"print(prefix_blocks({text!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert json.loads(out) == prefix_blocks(text)


def test_request_blocks_only_for_generation_routes():
    body = json.dumps({"prompt": "p" * 1000}).encode()
    assert len(request_blocks("/v1/completions", body)) == 1000 // BLOCK_CHARS
    assert request_blocks("/v1/models", body) == []
    assert request_blocks("/v1/completions", b"{not json") == []
    assert request_blocks("/v1/completions", b"[1, 2]") == []
    assert request_blocks("/v1/completions", b"\xff\xfe") == []


def test_prefix_index_matches_the_longest_prefix_and_forgets_the_oldest():
    idx = PrefixIndex(max_blocks=5)
    idx.insert([1, 2, 3], "r0")
    assert idx.match([1, 2, 3, 4], "r0") == 3
    assert idx.match([1, 2, 9], "r0") == 2
    assert idx.match([7, 8], "r0") == 0 and idx.match([1], "r1") == 0
    idx.insert([10, 11, 12], "r0")  # 6 blocks > 5: block 1 goes first
    assert idx.size("r0") == 5 and idx.match([1], "r0") == 0
    assert idx.match([1, 2, 3], "r0") == 3  # later blocks of a chain still say how far
    idx.insert([2], "r0")  # sent again: the most recent now
    idx.insert([20], "r0")
    assert idx.match([1, 2], "r0") == 2 and idx.match([10], "r0") == 1
    idx.remove("r0")
    assert idx.size("r0") == 0 and idx.match([2], "r0") == 0


def test_choose_prefers_the_holder_unless_it_is_much_busier():
    idx = PrefixIndex()
    idx.insert([1, 2, 3], "a")
    idx.insert([1], "b")
    kw = {"imbalance": 4, "imbalance_ratio": 1.0}
    assert choose([1, 2, 3, 4], {"a": 3, "b": 0}, idx, **kw)[0] == "a"  # 3 - 0 <= 4
    assert choose([1, 2, 3, 4], {"a": 5, "b": 0}, idx, **kw) == ["b", "a"]  # much busier
    assert choose([1, 2, 3, 4], {"a": 20, "b": 10}, idx, **kw)[0] == "a"  # within 2x + 4
    assert choose([1, 2, 3, 4], {"a": 25, "b": 10}, idx, **kw)[0] == "b"
    assert choose([1, 2, 3, 4], {"a": 8, "b": 0}, idx)[0] == "a"  # the default: 8
    assert choose([1, 2, 3, 4], {"a": 9, "b": 0}, idx)[0] == "b"
    assert choose([1, 2, 3, 4], {"a": 3, "b": 0}, idx, imbalance=0, imbalance_ratio=0)[0] == "b"
    assert choose([9, 9], {"a": 0, "b": 1}, idx)[0] == "a"  # nobody holds it: least loaded
    assert choose([], {"a": 2, "b": 1}, idx)[0] == "b"
    assert choose([1], {}, idx) == []
    # equal loads and no match: the replica holding fewer blocks takes the new prefix
    assert choose([42], {"a": 0, "b": 0}, idx)[0] == "b"
    # a replica the router has never sent anything is a candidate like any other
    assert set(choose([1, 2, 3], {"a": 0, "b": 0, "c": 0}, idx)) == {"a", "b", "c"}


def test_choose_spreads_prompts_nobody_holds_over_idle_replicas():
    idx = PrefixIndex()
    firsts = {choose([], {"a": 0, "b": 0, "c": 0}, idx)[0] for _ in range(200)}
    assert firsts == {"a", "b", "c"}


def _conversations(num: int, turns: int, seed: int = 0) -> list[list[str]]:
    import random

    rnd = random.Random(seed)
    words = "river stone cloud paper garden window music field light harbor".split()
    convs = []
    for c in range(num):
        history, prompts = f"conversation {c}: ", []
        for _ in range(turns):
            history += " ".join(rnd.choice(words) for _ in range(60)) + "\n"
            prompts.append(history)
        convs.append(prompts)
    return convs


def _hit_rate(route) -> float:
    """Multi-turn chat over 2 replicas with per-replica exact prefix caches: the share of
    prompt characters each turn finds cached at the replica it is sent to."""
    held: dict[str, list[str]] = {"a": [], "b": []}
    hit = total = 0
    convs = _conversations(11, 5)  # odd: turn by turn, round robin alternates a conversation
    for turn in range(5):
        for conv in convs:
            prompt = conv[turn]
            replica = route(prompt)
            best = max((len(p) for p in held[replica] if prompt.startswith(p)), default=0)
            hit, total = hit + best, total + len(prompt)
            held[replica].append(prompt)
    return hit / total


def test_prefix_affinity_keeps_conversations_on_their_replica():
    idx, loads = PrefixIndex(), {"a": 0, "b": 0}

    def affinity(prompt):
        blocks = prefix_blocks(prompt)
        replica = choose(blocks, loads, idx)[0]
        idx.insert(blocks, replica)
        return replica

    turn = iter(range(10**6))
    round_robin = lambda prompt: "ab"[next(turn) % 2]
    single = lambda prompt: "a"
    one, rr, aff = _hit_rate(single), _hit_rate(round_robin), _hit_rate(affinity)
    assert one - aff < 0.05, (one, aff)
    assert aff - rr > 0.25, (aff, rr)


# -- the forwarded request through a replica's app ------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_long_context):
    yield from inprocess_served(tiny_long_context, max_model_len=4096)


@pytest.fixture(scope="module")
def app(served):
    return served[0]


def _forward(app, path: str, body: dict, close_after: int | None = None):
    """call_asgi's parts: (ResponseStart, body bytes); closes the stream after that many
    chunks if asked."""

    async def go():
        req = ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json")],
                               json.dumps(body).encode())
        parts = call_asgi(app, req, [(b"x-test", b"1")])
        start = await parts.__anext__()
        chunks = []
        async for chunk in parts:
            chunks.append(chunk)
            if close_after is not None and len(chunks) >= close_after:
                break
        await parts.aclose()
        return start, b"".join(chunks)

    return asyncio.run(go())


def _direct(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with asgi_client(app) as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def test_a_forwarded_request_answers_as_the_server_does(app):
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
    start, data = _forward(app, "/v1/completions", body)
    direct = _direct(app, "/v1/completions", body)
    assert isinstance(start, ResponseStart) and start.status == 200
    assert start.header(b"x-test") == b"1"
    got, want = json.loads(data), direct.json()
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    bad = {"prompt": "hi", "temperature": -1}
    start, data = _forward(app, "/v1/completions", bad)
    assert start.status == 400 == _direct(app, "/v1/completions", bad).status_code
    assert json.loads(data)["error"]["param"] == "temperature"
    start, data = _forward(app, "/v1/nowhere", {})
    assert start.status == 404 and json.loads(data)["error"]["type"] == "not_found_error"


def test_a_forwarded_stream_is_the_servers_stream(app):
    body = {"prompt": "stream me", "max_tokens": 8, "temperature": 0, "stream": True}
    start, data = _forward(app, "/v1/completions", body)
    assert start.header(b"content-type").startswith(b"text/event-stream")
    events = [line for line in data.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    plain = _direct(app, "/v1/completions", {**body, "stream": False}).json()
    assert text == plain["choices"][0]["text"]


def test_closing_a_forwarded_stream_aborts_its_request(served):
    app, aengine = served
    body = {"prompt": "a long one", "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, data = _forward(app, "/v1/completions", body, close_after=3)
    assert start.status == 200 and data.startswith(b"data: ")
    deadline = time.monotonic() + 10
    while aengine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not aengine.engine.has_unfinished() and aengine.num_streams == 0
    assert aengine.engine.cache.is_fully_free() or aengine.engine.prefix_cache


def test_a_replica_plans_from_its_own_share():
    from swaserve.ray.app import replica_config

    base = EngineConfig(mem_fraction=0.8)
    c = replica_config(base, num_cpus=2, node_cpus=8)
    assert c.num_threads == 2 and c.mem_fraction == pytest.approx(0.2)
    assert replica_config(EngineConfig(num_threads=3), 1, 8).num_threads == 3
    assert replica_config(EngineConfig(), 0.5, 8).num_threads == 1
    assert replica_config(EngineConfig(mem_fraction=0.5), 16, 8).mem_fraction == 0.5


def test_server_options_name_their_bad_values():
    for kw, name in (({"max_waiting": 0}, "max_waiting"),
                     ({"max_request_bytes": -5}, "max_request_bytes"),
                     ({"request_timeout": 0}, "request_timeout"),
                     ({"shutdown_timeout": -1.0}, "shutdown_timeout"),
                     ({"served_model_name": ("a", "")}, "served_model_name"),
                     ({"allowed_origins": [3]}, "allowed_origins")):
        with pytest.raises(ValueError, match=name):
            ServerOptions(**kw)
    assert ServerOptions(served_model_name="one").served_model_name == ("one",)
    assert ServerOptions(served_model_name=["a", "b"]).served_model_name == ("a", "b")
