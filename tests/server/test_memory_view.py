"""The memory view (`GET /v1/memory`, server/memory_view.py) and the chat page's routes: the
snapshot taken on the engine thread agrees with the engine's own counts while a request
runs, the key guards the data and not the page, and the assets are served from the
package."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from swaserve.server import routes_ui
from swaserve.server.app import create_app
from swaserve.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def served(tiny_long_context):
    from swaserve.engine.engine import Engine

    eng = Engine(model=tiny_long_context, dtype="float32", kv_memory="16MiB",
                 max_running_requests=4, page_size=4, chunk_size=16, prefix_cache=True)
    aeng = AsyncEngine(eng)
    yield create_app(aeng, "tiny", api_key="sekret"), aeng
    aeng.shutdown()
    assert eng.cache.is_fully_free()


KEY = {"Authorization": "Bearer sekret"}


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=60)


def test_the_view_follows_a_running_request(served):
    app, aeng = served
    body = {"messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 400,
            "ignore_eos": True}

    async def run():
        async with client(app) as c:
            idle = (await c.get("/v1/memory", headers=KEY)).json()
            answer = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=KEY))
            views = []
            while not answer.done() and len(views) < 3:
                view = (await c.get("/v1/memory", headers=KEY)).json()
                if view["requests"] and view["requests"][0]["phase"] == "decode":
                    views.append(view)
                await asyncio.sleep(0.05)
            assert (await answer).status_code == 200
            after = (await c.get("/v1/memory", headers=KEY)).json()
            return idle, views, after

    idle, views, after = asyncio.run(run())
    assert idle["object"] == "memory" and idle["model"] == "tiny" and idle["requests"] == []
    plan = idle["plan"]
    assert plan["allocated_bytes"] == plan["planned_bytes"] <= plan["budget_bytes"]
    assert idle["pool"]["rows"] == {"used": 0, "total": 4}
    assert idle["layout"]["sliding"] and idle["layout"]["full_layers"]
    running = [v for v in views if v["requests"]]
    assert running, "no snapshot saw the request"
    v = running[-1]
    (req,) = v["requests"]
    assert v["pool"]["rows"]["used"] == 1 and req["row"] in range(4)
    assert req["phase"] == "decode" and req["computed_tokens"] >= req["prompt_tokens"]
    full = v["pool"]["full_pages"]
    assert full["used"] == full["total"] - full["free"] and full["requests"] == req["full_pages"]
    assert req["full_pages"] * plan["page_size"] >= req["computed_tokens"]
    ring = req["ring"]
    assert ring["slots"] == plan["ring"]
    # a step in flight (overlap) may have written its positions before it counts as computed
    assert (min(req["computed_tokens"], ring["slots"]) <= ring["filled"]
            <= min(req["computed_tokens"] + 1, ring["slots"]))
    assert ring["live"] == [min(ring["filled"], g["window"]) for g in v["layout"]["sliding"]]
    assert after["requests"] == [] and after["pool"]["rows"]["used"] == 0
    assert after["prefix_cache"]["nodes"] > 0  # the finished prompt stays cached
    json.dumps(after)  # plain JSON all through


def test_the_key_guards_the_data_not_the_page(served):
    app, _ = served

    async def run():
        async with client(app) as c:
            return [await c.get(path) for path in ["/v1/memory", "/", "/ui/chat.js",
                                                   "/ui/nothing.js"]]

    memory, page, script, missing = asyncio.run(run())
    assert memory.status_code == 401
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/chat.js">' in page.text
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert missing.status_code == 401  # no asset: not a public path either


def test_the_page_needs_nothing_outside_the_package():
    assert {"chat.js", "chat.css", "markdown.js", "memory.js", "api.js",
            "store.js"} <= set(routes_ui.ASSETS)
    for name in [*routes_ui.ASSETS, "index.html"]:
        text = (routes_ui.STATIC / name).read_text()
        assert "http://" not in text.replace("http://t", "") and "cdn" not in text.lower()
        for ref in (part.split('"')[0] for part in text.split('src="')[1:]):
            assert ref.startswith("/ui/") and ref[4:] in routes_ui.ASSETS, ref


def test_a_stopped_engine_answers_503(tiny_with_tokenizer):
    from swaserve.engine.engine import Engine

    aeng = AsyncEngine(Engine(model=tiny_with_tokenizer, dtype="float32", kv_memory="8MiB"))
    app = create_app(aeng, "tiny")
    aeng.shutdown()

    async def run():
        async with client(app) as c:
            return await c.get("/v1/memory")

    r = asyncio.run(run())
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
