"""OpenAI's Responses answer: the engine's events as a `response` object and its stream of
named events, as the `openai` client's `responses.create` and `responses.stream` read them.

The chat path's output parser (chat/registry.py) reads the tokens into reasoning, content
and calls; here they become output items in the order they came: a `reasoning` item
(its text as one `reasoning_text` part), a `message` item (one `output_text` part) and a
`function_call` item per call. Without a parser the text is the message, or the call a
bare-JSON constraint made (chat/tools.py reads it), as openai/chat.py does.

A stream is `event: <type>` + `data: {...}` events with increasing `sequence_number`s:
`response.created`, `response.in_progress`, then per item `output_item.added`, its
`content_part.added`, deltas, their `.done`s and `output_item.done`, and at the end
`response.completed` (`response.incomplete` when max_output_tokens cut it) holding the
whole response, the same object a request without `stream` gets. A failure mid-stream
is `response.failed`, then the end.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable

from swaserve.chat.events import Event, OutputParser
from swaserve.chat.tools import ToolPlan, parse_calls
from swaserve.server.errors import APIError
from swaserve.server.events import Delta, Final
from swaserve.server.lifecycle import sse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_OF = {"reasoning": "reasoning", "content": "message", "call": "function_call",
            "arguments": "function_call"}


class OutputItems:
    """The response's output items built from parser events, and the stream events that
    build them: `feed(event)` and `close(status)` return the stream events (without
    sequence numbers) that say what changed."""

    def __init__(self):
        self.items: list[dict] = []
        self._open = False

    def feed(self, e: Event) -> list[dict]:
        kind = _ITEM_OF[e.kind]
        out: list[dict] = []
        if e.kind == "call" or not self._open or self.items[-1]["type"] != kind:
            if e.kind != "call" and not e.text:
                return out
            out += self.close("completed")
            out += self._start(kind, e)
            if e.kind == "call":
                return out
        if not e.text:
            return out
        item, at = self.items[-1], {"item_id": self.items[-1]["id"],
                                    "output_index": len(self.items) - 1}
        if kind == "reasoning":
            item["content"][0]["text"] += e.text
            out.append({"type": "response.reasoning_text.delta", **at, "content_index": 0,
                        "delta": e.text})
        elif kind == "message":
            item["content"][0]["text"] += e.text
            out.append({"type": "response.output_text.delta", **at, "content_index": 0,
                        "delta": e.text, "logprobs": []})
        else:
            item["arguments"] += e.text
            out.append({"type": "response.function_call_arguments.delta", **at,
                        "delta": e.text})
        return out

    def _start(self, kind: str, e: Event) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item = {"id": _id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("fc"), "type": "function_call", "call_id": e.call_id,
                    "name": e.name, "arguments": "", "status": "in_progress"}
            part = None
        self.items.append(item)
        self._open = True
        at = len(self.items) - 1
        out = [{"type": "response.output_item.added", "output_index": at,
                "item": copy.deepcopy(item)}]
        if part is not None:
            item["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": item["id"],
                        "output_index": at, "content_index": 0, "part": copy.deepcopy(part)})
        return out

    def close(self, status: str) -> list[dict]:
        """The open item finished (`completed`, or `incomplete` when the output was cut)."""
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        item["status"] = status
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out: list[dict] = []
        if item["type"] == "function_call":
            out.append({"type": "response.function_call_arguments.done", **at,
                        "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append({"type": "response.reasoning_text.done", **at, "content_index": 0,
                            "text": part["text"]})
            else:
                out.append({"type": "response.output_text.done", **at, "content_index": 0,
                            "text": part["text"], "logprobs": []})
            out.append({"type": "response.content_part.done", **at, "content_index": 0,
                        "part": copy.deepcopy(part)})
        out.append({"type": "response.output_item.done", "output_index": at["output_index"],
                    "item": copy.deepcopy(item)})
        return out


class ResponsesFormat:
    """One Responses request's answer (lifecycle.AnswerFormat). `echo` holds the request
    fields the response object repeats (tools, tool_choice, text, metadata, ...). One
    engine event may open and close items, so `chunk` returns a batch of events, which
    `event` writes one by one."""

    done = ""

    def __init__(self, model: str, echo: dict, plan: ToolPlan | None,
                 parser: Callable[[], OutputParser] | None):
        self.id, self.model, self.echo = _id("resp"), model, echo
        self.created = int(time.time())
        self.plan, self.new_parser = plan, parser
        self.output = OutputItems()
        self._parser: OutputParser | None = None
        self._finish: str | None = None
        self._held = ""  # a bare-JSON call's text, read when the output ends
        self._named_id: str | None = None
        self._seq = 0

    # -- the engine's output as parser events ---------------------------------------------

    def _events(self, d: Delta) -> list[Event]:
        if d.finish_reason:
            self._finish = d.finish_reason
        if self.new_parser is not None:
            if self._parser is None:
                self._parser = self.new_parser()
            events = self._parser.feed(d.token_ids)
            return events + (self._parser.finish() if d.finish_reason else [])
        plan = self.plan
        if plan is None:
            return [Event("content", d.text)]
        if plan.mode == "named":  # the arguments stream as they come
            events = [Event("arguments", d.text)]
            if self._named_id is None:
                self._named_id = f"call_{uuid.uuid4().hex[:24]}"
                events.insert(0, Event("call", name=plan.name, call_id=self._named_id))
            return events
        self._held += d.text  # a required call: the whole text decides
        if not d.finish_reason:
            return []
        calls = parse_calls(self._held, plan)
        if not calls:
            return [Event("content", self._held)]
        return [e for k, c in enumerate(calls) for e in (
            Event("call", name=c["function"]["name"], call_id=c["id"], index=k),
            Event("arguments", c["function"]["arguments"], index=k))]

    # -- the response object --------------------------------------------------------------

    def _usage(self, final: Final) -> dict:
        output = sum(final.num_output_tokens)
        reasoning = self._parser.reasoning_tokens if self._parser is not None else 0
        return {"input_tokens": final.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": final.num_prompt_tokens + output}

    def _response(self, status: str, usage: dict | None = None,
                  error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model,
                "output": copy.deepcopy(self.output.items), "error": error,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "usage": usage, **self.echo}

    def _end(self) -> tuple[list[dict], str]:
        """The last item closed: its events, and the response's status."""
        status = "incomplete" if self._finish == "length" else "completed"
        return self.output.close(status), status

    def response(self, choices: list[Delta], final: Final) -> dict:
        for e in self._events(choices[0]):
            self.output.feed(e)
        _, status = self._end()
        return self._response(status, self._usage(final))

    # -- the stream -----------------------------------------------------------------------

    def _numbered(self, events: list[dict]) -> dict | None:
        if not events:
            return None
        for ev in events:
            ev["sequence_number"] = self._seq
            self._seq += 1
        return {"batch": events}

    def head(self) -> list[dict]:
        return [self._numbered([
            {"type": "response.created", "response": self._response("in_progress")},
            {"type": "response.in_progress", "response": self._response("in_progress")}])]

    def chunk(self, ev: Delta | Final) -> dict | None:
        if isinstance(ev, Final):
            events, status = self._end()
            events.append({"type": f"response.{status}",
                           "response": self._response(status, self._usage(ev))})
            return self._numbered(events)
        return self._numbered([s for e in self._events(ev) for s in self.output.feed(e)])

    def error(self, e: APIError) -> dict:
        code = "server_error" if e.status >= 500 else e.code or "server_error"
        return self._numbered([{"type": "response.failed", "response": self._response(
            "failed", error={"code": code, "message": e.message})}])

    def event(self, obj: dict) -> str:
        return "".join(f"event: {ev['type']}\n{sse(ev)}" for ev in obj["batch"])


def echoed(body, tools: list[dict] | None) -> dict:
    """The request fields a response repeats, as the client's Response model has them."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
            else {"type": "text"}}
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "name": choice.name}
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls":
            body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": text, "tool_choice": choice if choice is not None else "auto",
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description"),
                       "parameters": t["function"].get("parameters"),
                       "strict": t["function"].get("strict")} for t in tools or []],
            "truncation": "disabled", "user": body.user, "background": False}

