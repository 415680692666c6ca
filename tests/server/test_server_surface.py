"""A new API surface over the shared request lifecycle (server/lifecycle.py): a module of
routes maps its body to SamplingParams and a prompt, hands them to `prepare` and `answer`,
and gets its answer, its stream events and its errors in its own shape, while the OpenAI
routes beside it keep theirs."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from swaserve.sampling.params import SamplingParams
from swaserve.server import app as app_module
from swaserve.server.errors import APIError
from swaserve.server.events import Delta, Final
from swaserve.server.lifecycle import answer, encode, prepare
from swaserve.server.metrics import Metrics
from swaserve.server.state import AppState


class PlainRequest(BaseModel):
    text: str
    max_tokens: int | None = None
    stream: bool = False


class PlainFormat:
    """The test surface's answer: named events (`event: delta`), no [DONE], its own error."""

    done = "event: end\ndata: {}\n\n"

    def __init__(self):
        self.id = f"plain-{uuid.uuid4().hex}"

    def head(self) -> list[dict]:
        return [{"type": "start", "id": self.id}]

    def chunk(self, ev: Delta | Final) -> dict | None:
        if isinstance(ev, Final):
            return {"type": "stop", "tokens": sum(ev.num_output_tokens)}
        return {"type": "delta", "text": ev.text} if ev.text else None

    def response(self, choices: list[Delta], final: Final) -> dict:
        return {"id": self.id, "text": choices[0].text, "tokens": sum(final.num_output_tokens)}

    def error(self, e: APIError) -> dict:
        return plain_error(e)

    def event(self, obj: dict) -> str:
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n"


def plain_error(e: APIError) -> dict:
    return {"type": "error", "error": {"kind": e.type, "message": e.message}}


def add_plain_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/plain/generate")
    async def generate(body: PlainRequest, request: Request):
        params = SamplingParams(temperature=0.0, ignore_eos=True)
        prepared = await prepare(state, params, lambda: encode(state, body.text, "text"),
                                 "text", body.max_tokens, None)
        return await answer(state, request, [prepared], PlainFormat(), body.stream)


@pytest.fixture(scope="module")
def served(tiny_with_tokenizer):
    from swaserve.engine.engine import Engine
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=tiny_with_tokenizer, dtype="float32", kv_memory="16MiB",
                 max_model_len=128)
    aeng = AsyncEngine(eng)
    app = app_module.create_app(aeng, "tiny")
    add_plain_routes(app, AppState.of(aeng, "tiny", Metrics()))
    yield app, aeng
    aeng.shutdown()
    assert eng.cache.is_fully_free()


def post(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            return await asyncio.gather(*[c.post(path, json=body) for path, body in requests])
    return asyncio.run(run())


def test_a_new_surface_answers_in_its_own_shape(served):
    app, _ = served
    whole, stream, openai = post(app, [
        ("/plain/generate", {"text": "hello", "max_tokens": 6}),
        ("/plain/generate", {"text": "hello", "max_tokens": 6, "stream": True}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 6, "temperature": 0,
                             "ignore_eos": True})])
    assert whole.status_code == 200 and whole.json()["tokens"] == 6
    assert whole.json()["text"] == openai.json()["choices"][0]["text"]  # the same lifecycle
    events = [block.split("\n") for block in stream.text.split("\n\n") if block]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names[0] == "start" and names[-2:] == ["stop", "end"]
    assert set(names[1:-2]) <= {"delta"}
    data = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert "".join(d["text"] for d in data if d.get("type") == "delta") == whole.json()["text"]
    assert data[-2]["tokens"] == 6


def test_a_new_surface_has_its_own_error_shape(served, monkeypatch):
    app, aeng = served
    monkeypatch.setattr(app_module, "_ERROR_BODIES", (("/plain/", plain_error),))
    too_long, invalid, unknown, openai = post(app, [
        ("/plain/generate", {"text": "hello", "max_tokens": 1000}),  # the lifecycle's 400
        ("/plain/generate", {"max_tokens": 3}),  # the body's validation
        ("/plain/nowhere", {}),  # a path of the surface that is no route
        ("/v1/completions", {"prompt": "hello", "max_tokens": 1000})])
    assert too_long.status_code == 400
    assert too_long.json() == {"type": "error", "error": {
        "kind": "invalid_request_error", "message": too_long.json()["error"]["message"]}}
    assert too_long.json()["error"]["message"].startswith("max_tokens: ")
    assert invalid.status_code == 400 and invalid.json()["error"]["message"].startswith("text:")
    assert unknown.status_code == 404 and unknown.json()["error"]["kind"] == "not_found_error"
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "max_tokens"
    assert aeng.num_queued == 0  # every refused request's admission was handed back
