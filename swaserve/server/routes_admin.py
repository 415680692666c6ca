"""The operator's routes: /health (the engine thread alive, or draining for shutdown) and
/metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from swaserve.server.errors import error_response
from swaserve.server.state import AppState


def add_routes(app: FastAPI, state: AppState) -> None:
    aengine = state.aengine

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return error_response(503, f"the engine stopped: {aengine.dead}", None,
                                  "server_error", "engine_dead")
        return {"status": "shutting_down" if aengine.draining else "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
