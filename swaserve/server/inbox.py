"""The commands an AsyncEngine's inbox carries to its engine thread (async_engine.py), and
what the thread keeps of an embedding request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swaserve.engine.embedder import EmbedJob
from swaserve.engine.engine import Engine
from swaserve.sampling.grammar import CompiledGrammar
from swaserve.sampling.params import SamplingParams
from swaserve.server.events import EngineError, Stream


@dataclass(frozen=True)
class Add:
    """Queue a request (its stream is where its events go)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None
    stream: Stream


@dataclass(frozen=True)
class Abort:
    """Drop a request and free its memory (its client went away)."""

    request_id: str


@dataclass(frozen=True)
class FailAll:
    """End every request with this message (shutdown's last word to the clients)."""

    message: str


@dataclass(frozen=True)
class Stop:
    """Abort every request and end the engine thread."""


@dataclass(frozen=True)
class Embed:
    """Queue prompts to embed (engine/embedder.py); `reply` gets their vectors or an
    EngineError, on the engine thread. `Abort(request_id)` drops them."""

    request_id: str
    prompts: list[list[int]]
    reply: Callable[[list[list[float]] | EngineError], None]
    deadline: float | None


@dataclass
class Embedding:
    """An embedding request in the embedder's queue, as the engine thread tracks it."""

    job: EmbedJob
    reply: Callable[[list[list[float]] | EngineError], None]
    deadline: float | None


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` on the engine thread between two steps (a consistent read of its
    state); `reply` gets the result or the exception."""

    fn: Callable[[Engine], object]
    reply: Callable[[object], None]


Command = Add | Abort | FailAll | Stop | Embed | Call  # what the engine thread's inbox carries
