"""The HTTP app (FastAPI): one server's routes, by API surface, over the shared request
lifecycle (lifecycle.py), and its errors.

Routes: routes_openai.py (models, completions, chat), routes_embeddings.py
(/v1/embeddings), routes_tokens.py (/tokenize, /detokenize, /tokenizer_info),
routes_admin.py (/health, /metrics). Every error leaves as
`{"error": {message, type, param, code}}` (OpenAI's shape) unless its path belongs to a
surface in `_ERROR_BODIES`; a failure of one request inside the engine reaches that request
only: a 5xx body, or in a stream an error event and then the stream's end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.server import routes_admin, routes_embeddings, routes_openai, routes_tokens
from swaserve.server.async_engine import AsyncEngine
from swaserve.server.errors import APIError, validation_error
from swaserve.server.guard import Guard
from swaserve.server.metrics import REJECT_REASONS, Metrics
from swaserve.server.state import AppState

log = logging.getLogger("swaserve")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2
_REJECTED = {400: "invalid", 404: "not_found", 413: "too_large"}
# (path prefix, APIError -> body) of each surface whose errors are not in OpenAI's shape
_ERROR_BODIES: tuple[tuple[str, Callable[[APIError], dict]], ...] = ()


def create_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               public_paths: frozenset[str] = frozenset(), *, chat_template: str | None = None,
               template_kwargs: Mapping[str, Any] | None = None, reasoning_parser: str = "auto",
               tool_parser: str = "auto") -> FastAPI:
    """The app of one engine. `chat_template` (a template's text) replaces the model's
    own; `template_kwargs` are the template variables every chat gets by default; the
    parsers name the output's formats (chat_output.py), `auto` or `none`."""
    metrics = Metrics()
    aengine.metrics = metrics
    metrics.on_state(aengine.engine.stats())
    aengine.engine.grammars.warm_up()  # the grammar token table, built before the first request
    state = AppState.of(aengine, model_name, metrics, chat_template, template_kwargs,
                        reasoning_parser, tool_parser)
    app = FastAPI(title="swaserve", docs_url=None, redoc_url=None)
    _add_error_handlers(app, metrics)
    routes_admin.add_routes(app, state)
    routes_openai.add_routes(app, state)
    routes_tokens.add_routes(app, state)
    routes_embeddings.add_routes(app, state)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes,
                       public_paths=public_paths,
                       on_reject=lambda reason: metrics.rejected.labels(reason).inc())
    return app


def _error_response(request: Request, e: APIError) -> JSONResponse:
    path = request.url.path
    body = next((fn for prefix, fn in _ERROR_BODIES if path.startswith(prefix)), APIError.body)
    return JSONResponse(body(e), status_code=e.status, headers=e.headers)


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as an APIError in its surface's shape; a refused request is counted by
    its reason."""

    def reject(request: Request, e: APIError) -> JSONResponse:
        reason = _REJECTED.get(e.status) or (e.code if e.status == 503 else None)
        if reason is not None and reason in REJECT_REASONS:
            metrics.rejected.labels(reason).inc()
        return _error_response(request, e)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return reject(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return reject(request, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return reject(request, APIError(e.status_code, str(e.detail), None, type_))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return _error_response(request, APIError(500, f"internal error: {type(e).__name__}",
                                                 None, "server_error"))
