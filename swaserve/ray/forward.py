"""An HTTP request carried from the ingress to an engine replica, and its answer carried
back: the replica runs the request through its own swaserve app in process (an ASGI call),
so routes, auth, validation and errors are exactly `swaserve serve`'s.

The answer travels as a stream: a `ResponseStart`, then the body's chunks. When the caller
stops reading (its client left), the app sees `http.disconnect`, as it would from uvicorn,
and aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

_APP_EXIT_S = 5.0  # how long a disconnected request's handler gets to end by itself


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


async def call_asgi(app, req: ForwardedRequest,
                    extra_headers: list[tuple[bytes, bytes]] = ()
                    ) -> AsyncIterator[ResponseStart | bytes]:
    """Run one request through an ASGI app; yields its ResponseStart (with extra_headers
    added), then its body chunks."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": req.method, "scheme": "http",
             "path": req.path, "raw_path": req.path.encode(), "root_path": "",
             "query_string": req.query_string, "headers": list(req.headers),
             "client": ("ingress", 0), "server": ("replica", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False
    end = object()

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(end))
    try:
        while True:
            message = await sent.get()
            if message is end:
                task.result()  # the app's own exception, if it raised one
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"],
                                    list(message.get("headers", [])) + list(extra_headers))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=_APP_EXIT_S)
            task.cancel()
