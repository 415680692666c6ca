"""The server's outer ASGI layers: API-key auth and the request body limit, and CORS.

The key comes as `Authorization: Bearer KEY` (OpenAI's clients; the scheme in any case) or `x-api-key: KEY`
(Anthropic's). A refusal is written in the shape of the surface its path belongs to
(`shape`, app.py's `error_shape`).

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps `receive` and would
hide a client's disconnect from the handlers). It reads the body itself, answers 413 as soon
as it passes `max_body_bytes`, and replays it to the app; after that the app's `receive`
is the client's own, so handlers still see `http.disconnect`. A CORS preflight passes
without the key: browsers never send credentials on one.

CORS (off unless origins are given) lets a web page on those origins call the API: the
preflight is answered for any method and header, since browser clients of OpenAI's API send
their own headers (x-stainless-*) beside Authorization and Content-Type.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence

from starlette.middleware.cors import CORSMiddleware

from swaserve.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class Guard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 public_paths: frozenset[str] = frozenset(),
                 on_reject: Callable[[str], None] | None = None,
                 shape: Callable[[str, APIError], tuple[int, dict]] | None = None):
        self.app = app
        self.shape = shape or (lambda path, e: (e.status, e.body()))
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS | public_paths
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.api_key and path not in self.open_paths and not (
                _is_preflight(scope["method"], headers)) and not self._authorized(headers):
            return await self._reject(send, path, "unauthorized", APIError(
                401, "invalid or missing API key", None, "authentication_error",
                "invalid_api_key"))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._reject(send, path, "too_large", self._too_large())
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left while sending
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._reject(send, path, "too_large", self._too_large())
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        key = self.api_key.encode()
        # the scheme is case-insensitive (RFC 7235): `bearer KEY` is as good as `Bearer KEY`
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        bearer = scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key)
        return secrets.compare_digest(headers.get(b"x-api-key", b""), key) or bearer

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds the server's limit of "
                        f"{self.max_body_bytes} bytes (--max-request-bytes)",
                        None, "invalid_request_error", "request_too_large")

    async def _reject(self, send, path: str, reason: str, e: APIError) -> None:
        if self.on_reject is not None:
            self.on_reject(reason)
        status, body = self.shape(path, e)
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def _is_preflight(method: str, headers: dict[bytes, bytes]) -> bool:
    return (method == "OPTIONS" and b"origin" in headers
            and b"access-control-request-method" in headers)


def add_cors(app, origins: Sequence[str]) -> None:
    """CORS for `origins` (`*`: any) as the app's outermost layer; none: no CORS."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
