"""Hermes' calls (Qwen2.5, Qwen3, NousResearch Hermes):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call, with
Qwen3's `<think>` reasoning where the template shows it."""

from __future__ import annotations

from swaserve.chat.calls import MarkedCalls
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.json_calls import CallsReader
from swaserve.chat.lark import Lark, exact_object, txt
from swaserve.chat.think import QWEN3_THINK


class HermesCalls(MarkedCalls):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5/3, Hermes);
    the json fallback adds a bare JSON call at the output's start and ``` fences."""

    opens = ("<tool_call>",)
    close = "</tool_call>"

    def enter(self, marker: str) -> None:
        self.state = "block"
        self.reader = CallsReader(self.calls.names, self.calls.start, self.calls.args)

    def s_block(self, final: bool) -> bool:
        return self.read_json(self.reader, lambda: setattr(self, "state", "closing"))


class Hermes(ChatFormat):
    """Hermes' calls in `<tool_call>` JSON blocks, Qwen3's `<think>` where shown."""

    name = "hermes"
    patterns = ((r"<tool_call>[ \t]*(\\n|\n)\s*\{",),)  # a JSON object inside
    reasoning = QWEN3_THINK  # where the template thinks (not Qwen2.5's, Hermes')
    calls = HermesCalls
    has_call_grammar = True

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        return " ".join([lk.mark("<tool_call>"), txt("\n"), lk.json(exact_object(
            {"name": {"const": name}, "arguments": args})), txt("\n"), lk.mark("</tool_call>")])

    def repeated_calls(self, call: str) -> str:
        return f"{call} ({txt(chr(10))} {call})*"  # parallel calls, one block a line
