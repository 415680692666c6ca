"""Anthropic's Messages answer: the engine's events as a `message` with content blocks, or
as its stream of named events, and errors in Anthropic's shape.

A completion's output is read as chat reads it (openai/chat.py): through the family's
output parser where there is one, else as the text itself, a named call's bare JSON, or a
required / auto call read back by chat/tools.py at the end. Its events become blocks in the
order they come: reasoning a `thinking` block (its signature empty: nothing here signs
it), content a `text` block, each call a `tool_use` block whose input streams as
`input_json_delta` fragments. The stream is message_start, ping, then per block
content_block_start / content_block_delta / content_block_stop, then message_delta (the
stop reason and the usage) and message_stop; a failure mid-stream is an `error` event.

Usage in Anthropic's terms: `input_tokens` are the prompt tokens not read from the prefix
cache, `cache_read_input_tokens` those that were (their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from swaserve.chat.events import Event, OutputParser
from swaserve.chat.stops import ContentStops
from swaserve.chat.tools import ToolPlan, parse_calls
from swaserve.server.errors import APIError
from swaserve.server.events import Delta, Final
from swaserve.server.lifecycle import sse

# an error's type by its HTTP status; the server's 503 (full, or its engine gone) is 529
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def error_status(e: APIError) -> int:
    return 529 if e.status == 503 else e.status


def error_body(e: APIError) -> dict:
    """`{"type": "error", "error": {type, message}}` of an APIError."""
    status = error_status(e)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class _Reader:
    """One completion's output as events, on either of chat's paths (module docstring)."""

    def __init__(self, new_parser: Callable[[], OutputParser] | None, plan: ToolPlan | None,
                 stop: list[str] | None):
        self.parser = new_parser() if new_parser is not None else None
        self.plan = plan
        self.stops = ContentStops(stop)  # a stop string cuts the content as it cuts the text
        self.held = ""  # a bare-JSON required / auto call: the text, read at the end
        self.named_open = False

    def feed(self, d: Delta) -> list[Event]:
        if self.parser is not None:
            events = self.parser.feed(d.token_ids)
            if d.finish_reason:
                events += self.parser.finish()
            return self.stops.read(events, bool(d.finish_reason), d.stop_reason)
        plan = self.plan
        if plan is None:
            return [Event("content", d.text)] if d.text else []
        if plan.mode == "named":
            events = [] if self.named_open else [Event("call", name=plan.name, call_id="")]
            self.named_open = True
            return events + ([Event("arguments", d.text)] if d.text else [])
        self.held += d.text
        if not d.finish_reason:
            return []
        calls = parse_calls(self.held, plan)
        if not calls:
            return [Event("content", self.held)] if self.held else []
        return [e for k, c in enumerate(calls)
                for e in (Event("call", name=c["function"]["name"], call_id="", index=k),
                          Event("arguments", c["function"]["arguments"], index=k))]

    @property
    def reasoning_tokens(self) -> int:
        return self.parser.reasoning_tokens if self.parser is not None else 0


class MessagesFormat:
    """The AnswerFormat of /v1/messages (lifecycle.py): one completion. A chunk that says
    several things is `{"batch": [events]}`, which `event` writes as that many SSE events."""

    done = ""

    def __init__(self, model: str, num_prompt_tokens: int,
                 parser: Callable[[], OutputParser] | None, plan: ToolPlan | None,
                 stop: list[str] | None):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.num_prompt_tokens = model, num_prompt_tokens
        self.reader = _Reader(parser, plan, stop)
        self.blocks: list[dict] = []  # the content so far; tool_use input as JSON text
        self.open = False  # the last block is still being written
        self.called = False
        self.stop: tuple[str, str | None] = ("end_turn", None)  # stop_reason, stop_sequence

    # -- events to blocks --------------------------------------------------------------------

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self.blocks.append(block)
        self.open = True
        shown = {**block, "input": {}} if block["type"] == "tool_use" else block
        return out + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                       "content_block": {**shown, **_EMPTY[block["type"]]}}]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _delta(self, field: str, kind: str, text: str) -> dict:
        self.blocks[-1][field] += text
        return {"type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": kind, _DELTA_FIELDS[kind]: text}}

    def _feed(self, d: Delta) -> list[dict]:
        """The stream events of one Delta, its blocks kept in `self.blocks`."""
        out: list[dict] = []
        for e in self.reader.feed(d):
            last = self.blocks[-1]["type"] if self.open else None
            if e.kind == "call":
                self.called = True
                out += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                    "name": e.name, "input": ""})
            elif e.kind == "arguments" and last == "tool_use" and e.text:
                out.append(self._delta("input", "input_json_delta", e.text))
            elif e.kind in ("reasoning", "content") and e.text:
                kind = "thinking" if e.kind == "reasoning" else "text"
                if last != kind:
                    out += self._start({"type": kind, kind: ""} | (
                        {"signature": ""} if kind == "thinking" else {}))
                out.append(self._delta(kind, f"{kind}_delta", e.text))
        if d.finish_reason:
            out += self._close()
            self.stop = _stop_reason(d, self.called)
        return out

    def _usage(self, final: Final) -> dict:
        return {"input_tokens": final.num_prompt_tokens - final.num_cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": final.num_cached_tokens,
                "output_tokens": sum(final.num_output_tokens)}

    # -- AnswerFormat ------------------------------------------------------------------------

    def head(self) -> list[dict]:
        message = self._message([], None, {
            "input_tokens": self.num_prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0})
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def chunk(self, ev: Delta | Final) -> dict | None:
        if isinstance(ev, Final):
            reason, sequence = self.stop
            return {"batch": [{"type": "message_delta", "usage": self._usage(ev),
                               "delta": {"stop_reason": reason, "stop_sequence": sequence}},
                              {"type": "message_stop"}]}
        out = self._feed(ev)
        return {"batch": out} if out else None

    def response(self, choices: list[Delta], final: Final) -> dict:
        self._feed(choices[0])
        content = [{**b, "input": _input(b["input"])} if b["type"] == "tool_use" else b
                   for b in self.blocks]
        return self._message(content, self.stop, self._usage(final))

    def error(self, e: APIError) -> dict:
        return error_body(e)

    def event(self, obj: dict) -> str:
        return "".join(f"event: {o['type']}\n{sse(o)}" for o in obj.get("batch", [obj]))

    def _message(self, content: list[dict], stop: tuple[str, str | None] | None,
                 usage: dict) -> dict:
        reason, sequence = stop or (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}


_EMPTY = {"thinking": {"thinking": ""}, "text": {"text": ""}, "tool_use": {}}
_DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking",
                 "input_json_delta": "partial_json"}


def _stop_reason(d: Delta, called: bool) -> tuple[str, str | None]:
    if d.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(d.stop_reason, str):
        return "stop_sequence", d.stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    """A call's input from its arguments' JSON; a call cut short (max_tokens) has none."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
