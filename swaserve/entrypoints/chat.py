"""Chat for the offline API: conversations checked, rendered with the model's chat template
and tokenized as the server's /v1/chat/completions does (chat/setup.py, chat/tools.py), and
each completion read back into a message (content, reasoning, tool calls) by the model's
chat format (chat/registry.py). `LLM.chat` and `swaserve chat` build on it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from swaserve.chat.events import Event, OutputParser
from swaserve.chat.registry import make_output_parser
from swaserve.chat.setup import ChatSetup, starts_with_bos
from swaserve.chat.tools import NO_ARGUMENTS, ToolPlan, template_messages
from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.sampling.params import SamplingParams

Conversation = list[dict[str, Any]]


@dataclass
class ChatMessage:
    """One completion read as an assistant message: its answer, its reasoning (None where
    the format has none or the model wrote none) and its tool calls (OpenAI's shape:
    `{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`)."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat turn, to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatPrompt(NamedTuple):
    """A conversation ready to generate: its rendered text and token ids, its sampling
    parameters (the chat's stop token added) and a maker of each completion's parser
    (None: the text is the answer as it is)."""

    text: str
    token_ids: list[int]
    params: SamplingParams
    parser: Callable[[], OutputParser] | None


def conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or several, as a list of them; a
    malformed message is a ValueError naming it."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages: a non-empty list of messages, or a list of such lists")
    convs = [list(messages)] if isinstance(messages[0], dict) else [list(c) for c in messages]
    for k, conv in enumerate(convs):
        where = f"messages[{k}]" if len(convs) > 1 else "messages"
        if not conv:
            raise ValueError(f"{where}: a conversation needs at least one message")
        for i, m in enumerate(conv):
            _check_message(m, f"{where}[{i}]")
    return convs


def _check_message(m: Any, where: str) -> None:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: a message is a dict, got {type(m).__name__}")
    if not isinstance(m.get("role"), str) or not m["role"]:
        raise ValueError(f"{where}: needs a 'role' (system, user, assistant or tool)")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(f"{where}.content: text or a list of text parts, got "
                         f"{type(content).__name__}")
    for j, c in enumerate(m.get("tool_calls") or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}]: needs function.name")
        if not isinstance(fn.get("arguments", ""), str):
            raise ValueError(f"{where}.tool_calls[{j}].function.arguments: JSON text")


def tool_plan(tools: Sequence[dict] | None) -> ToolPlan | None:
    """The plan of tools on offer (OpenAI's `{"type": "function", "function": {...}}`),
    which the model may call as it likes ("auto"); None without tools."""
    if not tools:
        return None
    params: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}]: needs function.name")
        if fn["name"] in params:
            raise ValueError(f"tools: the function name {fn['name']!r} is used twice")
        params[fn["name"]] = fn.get("parameters") or NO_ARGUMENTS
    return ToolPlan("auto", params, [copy.deepcopy(t) for t in tools])


def render_chat(setup: ChatSetup, tokenizer: Tokenizer, conv: Conversation,
                params: SamplingParams, plan: ToolPlan | None, *,
                chat_template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> ChatPrompt:
    """One conversation rendered and tokenized as the server's chat path does."""
    template = setup.template
    if continue_final_message and conv[-1]["role"] != "assistant":
        raise ValueError("continue_final_message: the last message must be the "
                         "assistant's, to be continued")
    # the template reads tool calls' arguments as objects: it gets copies
    messages = template_messages(copy.deepcopy(conv), plan, template.builtin)
    specs = plan.specs if plan is not None and not template.builtin else None
    text = template.render(messages, tools=specs, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           kwargs=chat_template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=not starts_with_bos(tokenizer, text))
    params = copy.copy(params)
    if setup.end_of_turn is not None:
        params.stop_token_ids = list(params.stop_token_ids or []) + [setup.end_of_turn]
    calls = plan is not None and setup.tools is not None
    parser = None
    if setup.reasoning is not None or calls:
        def parser() -> OutputParser:
            return make_output_parser(
                tokenizer, reasoning=setup.reasoning, tools=setup.tools if calls else None,
                tool_names=plan.parameters if calls else None, prompt=text)
    return ChatPrompt(text, ids, params, parser)


class MessageReader:
    """One completion's message, read as its tokens arrive: `feed` returns the new
    events (to stream), `message` the whole message so far."""

    def __init__(self, parser: OutputParser | None):
        self.parser = parser
        self.message = ChatMessage("")
        self._args: list[str] = []

    def feed(self, token_ids: Sequence[int], text: str = "") -> list[Event]:
        """New tokens (and, without a parser, their text, which is the answer as it is)."""
        if self.parser is None:
            return self.add([Event("content", text)] if text else [])
        return self.add(self.parser.feed(token_ids))

    def finish(self) -> list[Event]:
        return self.add(self.parser.finish() if self.parser is not None else [])

    def add(self, events: list[Event]) -> list[Event]:
        """Events added to the message; returned as they are."""
        m = self.message
        for e in events:
            if e.kind == "content":
                m.content += e.text
            elif e.kind == "reasoning":
                m.reasoning = (m.reasoning or "") + e.text
            elif e.kind == "call":
                m.tool_calls.append({"id": e.call_id, "type": "function",
                                     "function": {"name": e.name, "arguments": ""}})
            elif e.kind == "arguments" and e.index < len(m.tool_calls):
                m.tool_calls[e.index]["function"]["arguments"] += e.text
        return events


def read_message(parser: Callable[[], OutputParser] | None, token_ids: Sequence[int],
                 text: str) -> ChatMessage:
    """A finished completion's message."""
    reader = MessageReader(parser() if parser is not None else None)
    reader.feed(token_ids, text)
    reader.finish()
    for c in reader.message.tool_calls:  # a call without arguments written has "{}"
        c["function"]["arguments"] = c["function"]["arguments"] or json.dumps({})
    return reader.message
