"""`swaserve serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import uvicorn

from swaserve.cli.args import add_engine_args, engine_config
from swaserve.server.app import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("swaserve")


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop accepting (new requests get 503), let running requests
    finish for up to `shutdown_timeout` seconds, then end each one left with an error event
    (and `[DONE]`), so that uvicorn never has to cut a body. uvicorn re-raises the signal
    after its graceful shutdown, so the process would die of it; a clean, drained shutdown
    is exit status 0."""

    def __init__(self, config: uvicorn.Config, aengine, shutdown_timeout: float):
        super().__init__(config)
        self.aengine = aengine
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if not self.aengine.draining:
            self.aengine.draining = True
            threading.Thread(target=self._drain, name="swaserve-drain", daemon=True).start()
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.aengine.num_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.aengine.num_streams:
            log.info("shutting down: ending %d unfinished requests", self.aengine.num_streams)
            self.aengine.fail_streams("the server is shutting down: this request did not "
                                      f"finish within --shutdown-timeout "
                                      f"({self.shutdown_timeout:g} s)")

    @contextmanager
    def capture_signals(self):
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="model id reported and accepted")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="accepted requests not running yet beyond which new ones get 503 + "
                        "Retry-After")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which an unfinished request ends with an error "
                        "(default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds running requests get to finish before they are "
                        "ended with an error event")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (413 beyond)")
    p.add_argument("--public-path", action="append", default=[],
                   help="with --api-key, a path served without the key (e.g. /metrics); "
                        "repeatable. /health is always open")
    add_engine_args(p)
    p.set_defaults(func=run)


def default_model_name(engine) -> str:
    name = engine.source.path.name
    return name.removesuffix(".gguf") if engine.source.fmt == "gguf" else name


def run(args: argparse.Namespace) -> int:
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    logging.getLogger("swaserve").setLevel(logging.INFO)
    for name, v in (("max_waiting", args.max_waiting), ("max_request_bytes", args.max_request_bytes)):
        if v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v}")
    for name, v in (("request_timeout", args.request_timeout),
                    ("shutdown_timeout", args.shutdown_timeout)):
        if v is not None and not v > 0:
            raise ValueError(f"{name}: must be a positive number of seconds, got {v}")
    engine = Engine(engine_config(args))
    aengine = AsyncEngine(engine, max_waiting=args.max_waiting,
                          request_timeout=args.request_timeout)
    name = args.served_model_name or default_model_name(engine)
    app = create_app(aengine, name, args.api_key, args.max_request_bytes,
                     frozenset(args.public_path))

    @asynccontextmanager
    async def lifespan(_app):
        log.info("serving %s on http://%s:%d", name, args.host, args.port)
        yield
        aengine.shutdown()  # aborts what is still running, then stops the engine thread

    app.router.lifespan_context = lifespan
    # uvicorn's own limit is only a backstop: the drain above ends every stream first
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    GracefulServer(config, aengine, args.shutdown_timeout).run()
    return 0
