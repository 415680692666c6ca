"""`swaserve serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from contextlib import asynccontextmanager, contextmanager

import uvicorn

log = logging.getLogger("swaserve")


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
    of the signal; a clean, drained shutdown is exit status 0."""

    @contextmanager
    def capture_signals(self):
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def register(sub) -> None:
    from swaserve.cli import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model id reported and accepted")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 + Retry-After")
    add_engine_args(p)
    p.set_defaults(func=run)


def default_model_name(engine) -> str:
    name = engine.source.path.name
    return name.removesuffix(".gguf") if engine.source.fmt == "gguf" else name


def run(args: argparse.Namespace) -> int:
    from swaserve.cli import engine_config
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    logging.getLogger("swaserve").setLevel(logging.INFO)
    engine = Engine(engine_config(args))
    aengine = AsyncEngine(engine, max_waiting=args.max_waiting)
    name = args.served_model_name or default_model_name(engine)
    app = create_app(aengine, name, args.api_key)

    @asynccontextmanager
    async def lifespan(_app):
        log.info("serving %s on http://%s:%d", name, args.host, args.port)
        yield
        aengine.shutdown()  # aborts what is still running, then stops the engine thread

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    GracefulServer(config).run()
    return 0
