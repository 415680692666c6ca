"""Llama 3.1-3.3's calls: `<|python_tag|>` or a bare object at the output's start, then
`{"name": ..., "parameters": {...}}`, more of them after `;` or on the next lines.

A bare object may be an answer written in JSON as well as a call, so a call is said only
once its arguments parse: they come out whole, not streamed."""

from __future__ import annotations

from swaserve.chat.calls import MarkedCalls
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.json_calls import CallsReader
from swaserve.chat.lark import Lark, exact_object


class Llama3Calls(MarkedCalls):
    """Llama 3.1-3.3: `<|python_tag|>` or a bare object at the output's start, then
    `{"name": ..., "parameters": {...}}`, more of them after `;` or whitespace."""

    opens = ("<|python_tag|>",)
    special_opens = frozenset(opens)
    bare_at_start = "{"
    markers = frozenset(opens)

    def enter(self, marker: str) -> None:
        self.state = "block"
        self.reader = CallsReader(self.calls.names, self.calls.start, self.calls.args,
                                  lists=False, whole=True)

    def s_block(self, final: bool) -> bool:
        return self.read_json(self.reader, lambda: setattr(self, "state", "sep"))

    def s_sep(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            if final:
                self.buf = ""
            return False
        if s[0] in ";{":  # the next call, after `;` or on its own line
            self.buf = s[1:] if s[0] == ";" else s
            self.open_block("")
        else:
            self.buf = s
            self.close_calls()
        return True


class Llama3Json(ChatFormat):
    """Llama 3's JSON calls, after `<|python_tag|>` or bare."""

    name = "llama3_json"
    patterns = ((r"<\|python_tag\|>|<\|eom_id\|>",), (r"<\|start_header_id\|>", r'"parameters"'))
    calls = Llama3Calls
    has_call_grammar = True

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        return lk.json(exact_object({"name": {"const": name}, "parameters": args}))
