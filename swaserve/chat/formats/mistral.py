"""Mistral's calls: `[TOOL_CALLS]name[ARGS]{...}` (Small 3.2 and newer, `[CALL_ID]id`
allowed before `[ARGS]`), and the older `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
Magistral's `[THINK]`…`[/THINK]` reasoning where the template shows it."""

from __future__ import annotations

import random
import string

from swaserve.chat.calls import MarkedCalls
from swaserve.chat.events import find_marker, held_from
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.json_calls import CallsReader, JsonValueScan
from swaserve.chat.lark import Lark, exact_object, txt
from swaserve.chat.think import ThinkBlock

MISTRAL_THINK = ThinkBlock("mistral", "[THINK]", "[/THINK]", ("[THINK]", "[/THINK]"))


def mistral_call_id() -> str:
    """Mistral's templates check ids are nine letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralCalls(MarkedCalls):
    """`[TOOL_CALLS]name[ARGS]{...}` (Small 3.2 and newer, `[CALL_ID]id` allowed before
    `[ARGS]`), and the older `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    opens = ("[TOOL_CALLS]",)
    special_opens = frozenset(opens)
    markers = frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"})

    new_call_id = staticmethod(mistral_call_id)

    def enter(self, marker: str) -> None:
        self.state, self.name = "kind", ""

    def s_kind(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        self.buf = s
        if s[0] in "[{":
            self.state = "list"
            self.reader = CallsReader(self.calls.names, self.calls.start, self.calls.args)
        else:
            self.state = "name"
        return True

    def s_list(self, final: bool) -> bool:
        return self.read_json(self.reader, self.close_calls)

    def s_name(self, final: bool) -> bool:
        hit = find_marker(self.buf, ("[ARGS]", "[CALL_ID]"))
        if hit is None:
            k = len(self.buf) if final else held_from(self.buf, ("[ARGS]", "[CALL_ID]"))
            self.name += self.buf[:k]
            self.raw += self.buf[:k]
            self.buf = self.buf[k:]
            return False
        i, marker = hit
        self.name += self.buf[:i]
        self.raw += self.buf[:i + len(marker)]
        self.buf = self.buf[i + len(marker):]
        if self.state == "name" and not self.calls.start(self.name.strip()):
            return self.fail(self.buf)
        self.state = "call_id" if marker == "[CALL_ID]" else "args"
        self.scan = JsonValueScan()
        return True

    def s_call_id(self, final: bool) -> bool:
        hit = find_marker(self.buf, ("[ARGS]",))
        if hit is None:
            self.buf = self.buf[held_from(self.buf, ("[ARGS]",)):]
            return False
        self.buf = self.buf[hit[0] + len("[ARGS]"):]
        self.state = "args"
        return True

    def s_args(self, final: bool) -> bool:
        if self.scan.depth == 0:  # before the value: whitespace, then an object or array
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            if self.buf[0] not in "{[":
                self.calls.args("{}")
                self.close_calls()
                return True
        for i, ch in enumerate(self.buf):
            if self.scan.push(ch):
                self.calls.args(self.buf[:i + 1])
                self.buf = self.buf[i + 1:]
                self.close_calls()
                return True
        self.calls.args(self.buf)
        self.buf = ""
        return False


class Mistral(ChatFormat):
    """Mistral's `[TOOL_CALLS]` calls, Magistral's `[THINK]` where shown."""

    name = "mistral"
    patterns = ((r"\[TOOL_CALLS\]",),)
    reasoning = MISTRAL_THINK
    calls = MistralCalls
    has_call_grammar = True

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        if "[ARGS]" in template:  # Small 3.2 and later: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{}
            call_id = (f" {lk.mark('[CALL_ID]')} /[a-zA-Z0-9]{{9}}/" if "[CALL_ID]" in template
                       else "")
            return " ".join([lk.mark("[TOOL_CALLS]"), txt(name) + call_id, lk.mark("[ARGS]"),
                             lk.json(args)])
        listed = {"type": "array", "minItems": 1, "maxItems": 1,
                  "items": exact_object({"name": {"const": name}, "arguments": args})}
        return " ".join([lk.mark("[TOOL_CALLS]"), lk.json(listed)])
