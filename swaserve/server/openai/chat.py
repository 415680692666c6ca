"""OpenAI's chat answer: the engine's events as `chat.completion` chunks and responses.

Where the family's output has a structure (reasoning, tool calls in its own syntax), each
choice's tokens go through an output parser (chat_output.py) and come out as vLLM shapes
them: `reasoning_content`, `content` and `tool_calls` (a call's id, type and name first,
then its arguments in fragments), streamed as they are read, with `finish_reason`
"tool_calls" when a call was made. Without one, the text is the content, and a tool call
constrained to bare JSON (the built-in template, families without a call grammar) is read
back by tools.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from swaserve.sampling.params import SamplingParams
from swaserve.server.adapter import ResponseFormat, usage
from swaserve.server.chat_grammar import answer_grammar
from swaserve.server.chat_output import Event, OutputParser, make_output_parser
from swaserve.server.events import Delta, Final
from swaserve.server.logprobs import chat_logprobs
from swaserve.server.state import AppState
from swaserve.server.tools import ToolPlan, new_call, parse_calls


class ChatOutput:
    """How one chat request's output is constrained and read, decided once its prompt is
    rendered (its end says whether the output starts inside reasoning): a required or named
    call, or a JSON answer after reasoning (or a call, with tools on offer), in the family's
    own format (chat_grammar.py), else the constraint as given; and the output parser of
    each choice (chat_output.py)."""

    def __init__(self, state: AppState, body, plan: ToolPlan | None, params: SamplingParams):
        self.tok, self.plan, self.params = state.tokenizer, plan, params
        self.reasoning, self.tools = state.reasoning_parser, state.tool_parser
        template = state.template
        self.template = ("" if template is None or template.builtin
                         else template.source_for(plan is not None))
        self.json_bounds = state.engine.config.json_bounds
        self.parallel = body.parallel_tool_calls is not False
        self.prompt = ""
        self.family_call = False  # a required / named call in the family's syntax
        if plan is not None and plan.schema is not None:
            params.json_schema = plan.schema  # bare JSON, unless the family's syntax has a grammar

    def prompted(self, prompt: str) -> None:
        """The rendered prompt: the constraint in the family's format, where it has one."""
        self.prompt = prompt
        p, plan = self.params, self.plan
        schema = None
        if plan is None or plan.mode == "auto":  # a named or required call has its schema
            schema = {"type": "object"} if p.json_object else p.json_schema
        grammar = answer_grammar(self.tok, reasoning=self.reasoning, tools=self.tools,
                                 template=self.template, prompt=prompt, plan=plan,
                                 schema=schema, json_bounds=self.json_bounds)
        if grammar is not None:
            p.json_schema, p.json_object, p.grammar = None, False, grammar
            self.family_call = plan is not None and plan.mode != "auto"

    def parser(self) -> Callable[[], OutputParser] | None:
        """A maker of each choice's output parser; None where the text is the answer as it
        is (no reasoning format, no calls to read) or a bare-JSON call (tools.py reads it)."""
        plan = self.plan
        if plan is not None and plan.mode != "auto" and not self.family_call:
            return None
        calls = plan is not None and self.tools is not None
        if self.reasoning is None and not calls:
            return None
        names = None
        if calls:
            names = (plan.parameters if plan.mode != "named"
                     else {plan.name: plan.parameters[plan.name]})
        return lambda: make_output_parser(
            self.tok, reasoning=self.reasoning, tools=self.tools if calls else None,
            tool_names=names, parallel_tool_calls=self.parallel, prompt=self.prompt)


def cut_at_stop(events: list[Event], tail: str, stop: str) -> list[Event]:
    """A finishing choice's events with its content cut where the stop string begins
    (`tail`: the content said before these events, as far back as the string reaches)."""
    out, said = [], tail
    for e in events:
        if e.kind == "content":
            j = (said + e.text).find(stop)
            if j >= 0:
                kept = e.text[:max(0, j - len(said))]
                return out + ([replace(e, text=kept)] if kept else [])
            said += e.text
        out.append(e)
    return out


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
        self.tools = tools  # tools.py: how calls are constrained
        self.new_parser = parser  # one output parser per choice; None: the text as it is
        # a stop string cuts the parsed content as the engine cuts the text
        self.stop_reach = max(map(len, stop or [""]))
        self._tail = [""] * self.n  # each choice's last content, as far as a stop reaches
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
            if isinstance(d.stop_reason, str):
                events = cut_at_stop(events, self._tail[d.index], d.stop_reason)
        if self.stop_reach:
            said = self._tail[d.index] + "".join(e.text for e in events if e.kind == "content")
            self._tail[d.index] = said[-self.stop_reach:]
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
