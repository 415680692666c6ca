"""The operator's routes: /health and /metrics (Prometheus text). /health is 200 while the
engine thread runs and takes requests, and 503 (its body saying why) once the engine stopped
or the server drains for shutdown, so that a load balancer sends no more."""

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
        if aengine.draining:
            return error_response(503, "the server is shutting down", None, "server_error",
                                  "shutting_down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        # admissions handed back on the event loop (a request refused after tokenizing)
        # change no engine state, so the engine thread does not refresh this gauge for them
        state.metrics.waiting.set(aengine.num_queued)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
