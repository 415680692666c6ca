"""The HTTP app (FastAPI): one server's routes, by API surface, over the shared request
lifecycle (lifecycle.py), and its errors.

Routes: openai/routes.py (models, completions, chat), responses/routes.py
(/v1/responses, on the chat path), anthropic/routes.py (/v1/messages), openai/embeddings.py
(/v1/embeddings), routes_tokens.py (/tokenize, /detokenize, /tokenizer_info),
routes_admin.py (/health, /metrics). Every error leaves as `{"error": {message, type,
param, code}}` (OpenAI's shape) unless its path belongs to a surface in `_ERROR_BODIES`,
the guard's 401 and 413 included; a failure of one request inside the engine reaches that
request
only: a 5xx body, or in a stream an error event and then the stream's end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.server import routes_admin, routes_tokens, routes_ui
from swaserve.server.anthropic import answer as anthropic_format
from swaserve.server.anthropic import routes as routes_anthropic
from swaserve.server.async_engine import AsyncEngine
from swaserve.server.errors import APIError, validation_error
from swaserve.server.guard import Guard, add_cors
from swaserve.server.metrics import REJECT_REASONS, Metrics
from swaserve.server.openai import embeddings as routes_embeddings
from swaserve.server.openai import routes as routes_openai
from swaserve.server.responses import routes as routes_responses
from swaserve.server.state import AppState

log = logging.getLogger("swaserve")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2
_REJECTED = {400: "invalid", 404: "not_found", 413: "too_large"}
# (path prefix, APIError -> body[, APIError -> HTTP status]) of each surface whose errors
# are not in OpenAI's shape
_ERROR_BODIES: tuple[tuple[str, Callable[[APIError], Any]], ...] = (
    (routes_anthropic.PREFIX, anthropic_format.error_body, anthropic_format.error_status),
)


def create_app(aengine: AsyncEngine, model_name: str | Sequence[str],
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               public_paths: frozenset[str] = frozenset(), *, chat_template: str | None = None,
               template_kwargs: Mapping[str, Any] | None = None, reasoning_parser: str = "auto",
               tool_parser: str = "auto", allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app of one engine, served under one name or several (answers report the
    first). `chat_template` (a template's text) replaces the model's own; `template_kwargs`
    are the template variables every chat gets by default; the parsers name the output's
    formats (chat/registry.py), `auto` or `none`; `allowed_origins` turns on CORS for those
    browser origins."""
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
    routes_responses.add_routes(app, state)
    routes_anthropic.add_routes(app, state)
    routes_tokens.add_routes(app, state)
    routes_embeddings.add_routes(app, state)
    routes_ui.add_routes(app, state)  # the chat page at /, /v1/memory
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes,
                       public_paths=public_paths | routes_ui.PUBLIC_PATHS, shape=error_shape,
                       on_reject=lambda reason: metrics.rejected.labels(reason).inc())
    add_cors(app, allowed_origins)  # outermost: a refusal of the guard carries its headers
    return app


def error_shape(path: str, e: APIError) -> tuple[int, dict]:
    """(HTTP status, body) of an error on `path`, in its surface's shape."""
    for prefix, body, *status in _ERROR_BODIES:
        if path.startswith(prefix):
            return (status[0](e) if status else e.status), body(e)
    return e.status, e.body()


def _error_response(request: Request, e: APIError) -> JSONResponse:
    status, body = error_shape(request.url.path, e)
    return JSONResponse(body, status_code=status, headers=e.headers)


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
