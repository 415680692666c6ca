"""One server from an engine config and the server's own options: the engine, its thread
(AsyncEngine) and the app. `swaserve serve` runs it on uvicorn; each Ray Serve replica
(swaserve/ray/) builds one the same way, so a replica answers exactly as one server does."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from swaserve.config import EngineConfig
from swaserve.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from swaserve.server.async_engine import AsyncEngine


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = 1024
    request_timeout: float | None = None
    shutdown_timeout: float = 10.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    public_paths: frozenset[str] = frozenset()

    def __post_init__(self):
        for name in ("max_waiting", "max_request_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        for name in ("request_timeout", "shutdown_timeout"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {v!r}")


@dataclass
class Server:
    aengine: AsyncEngine
    app: FastAPI
    model_name: str


def default_model_name(engine) -> str:
    """The hub id as the user wrote it (`org/name`, `org/name-GGUF:Q8_0`); for a local
    path, its file name without .gguf or its directory's name."""
    if engine.source.hub_id is not None:
        return engine.source.hub_id
    name = engine.source.path.name
    return name.removesuffix(".gguf") if engine.source.fmt == "gguf" else name


def build_server(config: EngineConfig, options: ServerOptions) -> Server:
    from swaserve.engine.engine import Engine

    engine = Engine(config)
    aengine = AsyncEngine(engine, max_waiting=options.max_waiting,
                          request_timeout=options.request_timeout)
    name = options.served_model_name or default_model_name(engine)
    app = create_app(aengine, name, options.api_key, options.max_request_bytes,
                     options.public_paths)
    return Server(aengine, app, name)
