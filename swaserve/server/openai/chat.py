"""OpenAI's chat answer: the engine's events as `chat.completion` chunks and responses.

Where the family's output has a structure (reasoning, tool calls in its own syntax), each
choice's tokens go through an output parser (chat/registry.py) and come out as vLLM shapes
them: `reasoning_content`, `content` and `tool_calls` (a call's id, type and name first,
then its arguments in fragments), streamed as they are read, with `finish_reason`
"tool_calls" when a call was made. Without one, the text is the content, and a tool call
constrained to bare JSON (the built-in template, families without a call grammar) is read
back by chat/tools.py.
"""

from __future__ import annotations

from collections.abc import Callable

from swaserve.chat.events import Event, OutputParser
from swaserve.chat.stops import ContentStops
from swaserve.chat.tools import ToolPlan, new_call, parse_calls
from swaserve.server.events import Delta, Final
from swaserve.server.openai.adapter import ResponseFormat, usage
from swaserve.server.openai.logprobs import chat_logprobs


def message_delta(events: list[Event]) -> dict:
    """One chunk's delta from a run of events: reasoning and content joined, each call's
    start and argument fragments merged under its index."""
    delta: dict = {}
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, dict] = {}
    for e in events:
        if e.kind == "call":
            calls[e.index] = {"index": e.index, "id": e.call_id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif e.kind == "arguments":
            part = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            part["function"]["arguments"] += e.text
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, *args, tools: ToolPlan | None = None,
                 parser: Callable[[], OutputParser] | None = None,
                 stop: list[str] | None = None, **kw):
        super().__init__(*args, **kw)
        self.tools = tools  # chat/tools.py: how calls are constrained
        self.new_parser = parser  # one output parser per choice; None: the text as it is
        # a stop string cuts the parsed content as the engine cuts the text
        self._stops = [ContentStops(stop) for _ in range(self.n)]
        self._parsers: list[OutputParser | None] = [None] * self.n
        self._called = [False] * self.n  # the choice made a call
        self._reasoning_tokens = [0] * self.n
        self._named_call: list[dict | None] = [None] * self.n  # bare-JSON named call
        self._held = [""] * self.n  # bare-JSON required call: text held until the end

    def head(self) -> list[dict]:  # each choice opens with its role
        return [self._envelope(self.chunk_object, [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for i in range(self.n)]

    def _logprobs(self, d: Delta) -> dict | None:
        if self.num_logprobs is None:
            return None
        return chat_logprobs(self.tok, d, self.num_logprobs)

    def _usage(self, final: Final) -> dict:
        out = usage(final)
        if self.new_parser is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(self._reasoning_tokens)}
        return out

    def chunk(self, ev: Delta | Final) -> dict | None:
        if isinstance(ev, Final):
            return {**self._envelope(self.chunk_object, []), "usage": self._usage(ev)} \
                if self.include_usage else None
        choice = self._chunk_choice(ev)
        return None if choice is None else self._envelope(self.chunk_object, [choice])

    def response(self, choices: list[Delta], final: Final) -> dict:
        out = [self._choice(c) for c in choices]
        return {**self._envelope(self.object, out), "usage": self._usage(final)}

    def _finish(self, d: Delta, called: bool) -> str | None:
        return "tool_calls" if called and d.finish_reason == "stop" else d.finish_reason

    def _events(self, d: Delta, parser: OutputParser) -> list[Event]:
        events = parser.feed(d.token_ids)
        if d.finish_reason:
            events += parser.finish()
        events = self._stops[d.index].read(events, bool(d.finish_reason), d.stop_reason)
        self._reasoning_tokens[d.index] = parser.reasoning_tokens
        self._called[d.index] |= any(e.kind == "call" for e in events)
        return events

    def _chunk_choice(self, d: Delta) -> dict | None:
        if self.new_parser is not None:
            parser = self._parsers[d.index]
            if parser is None:
                parser = self._parsers[d.index] = self.new_parser()
            delta = message_delta(self._events(d, parser))
            if not delta and not d.finish_reason and self.num_logprobs is None:
                return None  # markup only: nothing to say yet
            return {"index": d.index, "delta": delta, "logprobs": self._logprobs(d),
                    "finish_reason": self._finish(d, self._called[d.index])}
        plan = self.tools
        if plan is not None and plan.mode == "named":
            return self._named_chunk(d, plan)
        if plan is not None:  # a bare-JSON required call: the whole text decides
            self._held[d.index] += d.text
            if not d.finish_reason:
                return None
            text = self._held[d.index]
            calls = parse_calls(text, plan)
            delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                     if calls else {"content": text})
            return {"index": d.index, "delta": delta, "logprobs": self._logprobs(d),
                    "finish_reason": self._finish(d, bool(calls))}
        delta = {"content": d.text} if d.text or not d.finish_reason else {}
        return {"index": d.index, "delta": delta, "logprobs": self._logprobs(d),
                "finish_reason": d.finish_reason}

    def _named_chunk(self, d: Delta, plan: ToolPlan) -> dict:
        """A named call constrained to bare JSON: the arguments stream as they come, the
        call's name and id first."""
        first = self._named_call[d.index] is None
        if first:
            self._named_call[d.index] = new_call(plan.name, "")
        call = self._named_call[d.index]
        part = {"index": 0, "function": {"arguments": d.text}}
        if first:
            part = {**part, "id": call["id"], "type": "function",
                    "function": {"name": plan.name, "arguments": d.text}}
        finish = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
        return {"index": d.index, "delta": {"tool_calls": [part]},
                "logprobs": self._logprobs(d), "finish_reason": finish}

    def _choice(self, d: Delta) -> dict:
        if self.new_parser is not None:
            events = self._events(d, self.new_parser())
            parsed = message_delta(events)
            calls = [{"id": c["id"], "type": "function", "function": c["function"]}
                     for c in parsed.get("tool_calls", [])]
            message = {"role": "assistant",
                       "content": parsed.get("content", None if calls else ""),
                       "reasoning_content": parsed.get("reasoning_content")}
            if calls:
                message["tool_calls"] = calls
            return {"index": d.index, "message": message, "logprobs": self._logprobs(d),
                    "finish_reason": self._finish(d, bool(calls)),
                    "stop_reason": d.stop_reason}
        calls = parse_calls(d.text, self.tools) if self.tools is not None else None
        message = ({"role": "assistant", "content": None, "tool_calls": calls} if calls
                   else {"role": "assistant", "content": d.text})
        return {"index": d.index, "message": message, "logprobs": self._logprobs(d),
                "finish_reason": self._finish(d, bool(calls)), "stop_reason": d.stop_reason}
