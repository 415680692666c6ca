"""The server's options that shape its surface rather than its answers, in process: one
model's object (`client.models.retrieve`), several served names, CORS for browser clients
(with and without an API key) and /health while the server drains for shutdown."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.conftest import TEST_DEVICE, asgi_client, run_client

NAMES = ("tiny", "org/tiny-alias")
ORIGIN, OTHER = "https://app.example.com", "https://evil.example.com"


@pytest.fixture(scope="module")
def aengine(tiny_with_tokenizer):
    from swaserve.engine.engine import Engine
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE,
                 kv_memory="8MiB", max_model_len=256)
    aeng = AsyncEngine(eng)
    yield aeng
    aeng.shutdown()


def make_app(aengine, **kw):
    from swaserve.server.app import create_app

    return create_app(aengine, NAMES, allowed_origins=(ORIGIN,), **kw)


@pytest.fixture(scope="module")
def app(aengine):
    return make_app(aengine)


def test_models_retrieve_finds_each_name_and_404s_another(app):
    async def go(client, _http):
        found = [await client.models.retrieve(name) for name in NAMES]
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-4o")
        listed = await client.models.list()
        return found, missing.value, [m.id for m in listed.data]

    found, missing, listed = run_client(app, go)
    assert [m.id for m in found] == list(NAMES) and listed == list(NAMES)
    assert all(m.object == "model" and m.owned_by == "swaserve" for m in found)
    assert missing.status_code == 404 and missing.body["param"] == "model"
    assert missing.body["code"] == "model_not_found" and "gpt-4o" in missing.body["message"]


def test_a_request_under_any_served_name_is_served_and_reports_the_first(app):
    async def go(client, _http):
        out = [await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            for name in NAMES]
        out.append(await client.completions.create(model=NAMES[1], prompt="hi", max_tokens=2))
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="other", prompt="hi", max_tokens=2)
        return out, missing.value

    answers, missing = run_client(app, go)
    assert [a.model for a in answers] == [NAMES[0]] * 3
    assert "'tiny', 'org/tiny-alias'" in missing.body["message"]


def call(app, method: str, path: str, headers: dict) -> list:
    async def go():
        async with asgi_client(app) as c:
            return await c.request(method, path, headers=headers)
    return asyncio.run(go())


def preflight(origin: str) -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


@pytest.mark.parametrize("api_key", [None, "sesame"])
def test_cors_answers_allowed_origins_only(aengine, api_key):
    app = make_app(aengine, api_key=api_key)
    ok = call(app, "OPTIONS", "/v1/chat/completions", preflight(ORIGIN))
    assert ok.status_code == 200, ok.text  # the key guard lets a preflight through
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    allowed = ok.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("authorization", "content-type", "x-stainless-os"))
    refused = call(app, "OPTIONS", "/v1/chat/completions", preflight(OTHER))
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers

    auth = {"Authorization": "Bearer sesame"} if api_key else {}
    got = call(app, "GET", "/v1/models", {"Origin": ORIGIN, **auth})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
    other = call(app, "GET", "/v1/models", {"Origin": OTHER, **auth})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    if api_key:  # a refusal carries the headers too, so the page can read why
        no_key = call(app, "GET", "/v1/models", {"Origin": ORIGIN})
        assert no_key.status_code == 401
        assert no_key.headers["access-control-allow-origin"] == ORIGIN


def test_without_allowed_origins_there_is_no_cors(aengine):
    from swaserve.server.app import create_app

    app = create_app(aengine, "tiny", api_key="sesame")
    r = call(app, "OPTIONS", "/v1/models", preflight(ORIGIN))
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = call(app, "GET", "/v1/models", {"Origin": ORIGIN, "Authorization": "Bearer sesame"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_health_is_503_while_draining(app, aengine):
    assert call(app, "GET", "/health", {}).json() == {"status": "ok"}
    aengine.draining = True  # what a SIGTERM does first (cli/serve.py GracefulServer)
    try:
        r = call(app, "GET", "/health", {})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in r.json()["error"]["message"]
    finally:
        aengine.draining = False
    assert call(app, "GET", "/health", {}).status_code == 200
