"""What every route of one server reads: the engine thread, the served model's names and
context, the tokenizer and chat template, the metrics. `create_app` builds it once and
hands it to each module of routes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swaserve.chat.setup import chat_setup
from swaserve.chat.template import ChatTemplate
from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.engine import Engine
from swaserve.server.async_engine import AsyncEngine
from swaserve.server.errors import APIError
from swaserve.server.metrics import Metrics

AUTO, NONE = "auto", "none"  # parser choices besides a format's name


@dataclass(frozen=True)
class AppState:
    aengine: AsyncEngine
    model_names: tuple[str, ...]  # the names a request may use; answers report the first
    metrics: Metrics
    template: ChatTemplate | None  # None: the model has no tokenizer, so no chat
    end_of_turn: int | None  # a stop token of every chat (Gemma's, under the built-in template)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the server's defaults
    # the output's formats (chat/registry.py): reasoning, and tool calls; None: none
    reasoning_parser: str | None = None
    tool_parser: str | None = None

    @classmethod
    def of(cls, aengine: AsyncEngine, model_names: str | Sequence[str], metrics: Metrics,
           chat_template: str | None = None,
           template_kwargs: Mapping[str, Any] | None = None, reasoning_parser: str = AUTO,
           tool_parser: str = AUTO) -> AppState:
        """`model_names`: one name or several (the first is the one answers report);
        `chat_template` (a template's text) replaces the model's own templates; the
        parsers are named, `auto` (what the template's syntax says) or `none`."""
        names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
        if not names:
            raise ValueError("model_names: at least one name")
        tok = aengine.engine.tokenizer
        template = end_of_turn = None
        formats: tuple[str | None, str | None] = (None, None)
        if tok is not None:
            template, end_of_turn, *found = chat_setup(tok, chat_template)
            formats = tuple(found[k] if name == AUTO else None if name == NONE else name
                            for k, name in enumerate((reasoning_parser, tool_parser)))
        return cls(aengine, names, metrics, template, end_of_turn,
                   dict(template_kwargs or {}), *formats)

    @property
    def model_name(self) -> str:
        """The name answers report."""
        return self.model_names[0]

    @property
    def engine(self) -> Engine:
        return self.aengine.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.aengine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        """A request naming a model this server does not serve under any of its names is a
        404 (naming none is fine)."""
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(404, f"model {name!r} does not exist (this server serves "
                           f"{served})", "model", "not_found_error", "model_not_found")
