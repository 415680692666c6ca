"""One server from an engine config and the server's own options: the engine, its thread
(AsyncEngine) and the app. `swaserve serve` runs it on uvicorn; each Ray Serve replica
(swaserve/ray/) builds one the same way, so a replica answers exactly as one server does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from swaserve.chat.registry import REASONING_PARSERS, TOOL_PARSERS
from swaserve.chat.template import RESERVED_KWARGS
from swaserve.config import EngineConfig
from swaserve.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from swaserve.server.async_engine import AsyncEngine


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None
    # the names the model is served under (the first is reported); none: the hub id or
    # the file's name (default_model_name); one name may be given as a str
    served_model_name: tuple[str, ...] | str | None = ()
    max_waiting: int = 1024
    request_timeout: float | None = None
    shutdown_timeout: float = 10.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    public_paths: frozenset[str] = frozenset()
    chat_template: str | None = None  # a template's text, replacing the model's own
    # template variables every chat gets unless its request sets them
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    # the output's formats: a parser's name, "auto" (from the template) or "none"
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any)

    def __post_init__(self):
        for name in ("served_model_name", "allowed_origins"):
            v = getattr(self, name)
            v = () if v is None else (v,) if isinstance(v, str) else tuple(v)
            if not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"{name}: must be non-empty strings, got {v!r}")
            object.__setattr__(self, name, v)  # one shape, whatever the caller passed
        for name, known in (("reasoning_parser", REASONING_PARSERS),
                            ("tool_call_parser", TOOL_PARSERS)):
            if getattr(self, name) not in ("auto", "none", *known):
                raise ValueError(f"{name}: expected auto, none or one of {', '.join(known)}, "
                                 f"got {getattr(self, name)!r}")
        kwargs = self.default_chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError("default_chat_template_kwargs: must be a JSON object, got "
                             f"{kwargs!r}")
        reserved = sorted(RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"default_chat_template_kwargs: {reserved[0]!r} is set by each "
                             "request itself")
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
    model_name: str  # the name answers report (the first served name)


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
    names = options.served_model_name or (default_model_name(engine),)
    app = create_app(aengine, names, options.api_key, options.max_request_bytes,
                     options.public_paths, chat_template=options.chat_template,
                     template_kwargs=options.default_chat_template_kwargs,
                     reasoning_parser=options.reasoning_parser,
                     tool_parser=options.tool_call_parser,
                     allowed_origins=options.allowed_origins)
    return Server(aengine, app, names[0])
