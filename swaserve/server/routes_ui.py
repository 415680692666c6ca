"""The browser's routes: the chat page at `/` with its assets under `/ui/`, and the memory
view's data at `GET /v1/memory` (memory_view.py).

The page and its assets ship inside the package (server/static/): no CDN, no build step,
so it works on a machine with no internet. They are public paths (the page holds no
secret; it asks for the API key and sends it as a bearer token); `/v1/memory` is guarded
by the key like the rest of `/v1`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from swaserve.server.errors import error_response
from swaserve.server.events import EngineError
from swaserve.server.memory_view import snapshot
from swaserve.server.state import AppState

STATIC = Path(__file__).parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
ASSETS = sorted(p.name for p in STATIC.iterdir() if p.suffix in _TYPES and p.name != "index.html")
PUBLIC_PATHS = frozenset({"/"} | {f"/ui/{name}" for name in ASSETS})
_SNAPSHOT_TIMEOUT_S = 10.0  # a busy engine answers between two steps; a stopping one never


def add_routes(app: FastAPI, state: AppState) -> None:
    aengine = state.aengine
    # read once: the assets are small and never change while the server runs
    files = {name: (STATIC / name).read_bytes() for name in [*ASSETS, "index.html"]}
    headers = {"Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return Response(files["index.html"], media_type=_TYPES[".html"], headers=headers)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in ASSETS:
            return error_response(404, f"no asset {name!r}", None, "not_found_error")
        return Response(files[name], media_type=_TYPES[Path(name).suffix], headers=headers)

    @app.get("/v1/memory")
    async def memory():
        """What the KV cache holds now, per running request and per pool (memory_view.py
        documents the shape)."""
        try:
            view = await asyncio.wait_for(aengine.call(snapshot), _SNAPSHOT_TIMEOUT_S)
        except EngineError as e:
            return error_response(e.status, e.message, None, e.type, e.code)
        except TimeoutError:
            return error_response(503, "the engine did not answer in time", None,
                                  "server_error", "engine_busy")
        return {**view, "model": state.model_name, "max_model_len": state.max_model_len}
