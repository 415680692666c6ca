"""Gemma 4's tool calls, `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, whose values
are JSON-like with bare keys and strings between `<|"|>` marks. The call's body is turned
into the arguments' JSON as it streams: keys quoted, strings escaped, scalars as they are
(a number as float() spells it, `108.`, is a number; a bare word that is not a JSON scalar
becomes a string). A key without a value (`key:}`) has null, a trailing comma is dropped.
Its reasoning is a thought channel, `<|channel>thought`…`<channel|>`."""

from __future__ import annotations

import json

from swaserve.chat.calls import MarkedCalls
from swaserve.chat.events import held_from
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.tagged import json_value
from swaserve.chat.think import ThinkBlock

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
GEMMA4_THOUGHT = ThinkBlock("gemma4", "<|channel>thought", "<channel|>",
                            ("<|channel>", "<channel|>"))


class Gemma4Calls(MarkedCalls):
    """The calls above, streamed."""

    opens = (OPEN,)
    special_opens = frozenset(opens)
    markers = frozenset({OPEN, CLOSE, QUOTE})
    close = CLOSE

    def enter(self, marker: str) -> None:
        self.state, self.name = "call", ""

    def s_call(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith("call:"):
            self.raw += "call:"
            self.buf, self.state = s[len("call:"):], "name"
            return True
        if not s or ("call:".startswith(s) and not final):
            return False
        return self.fail(self.buf)

    def s_name(self, final: bool) -> bool:
        i = self.buf.find("{")
        if i < 0:
            self.name += self.buf
            self.raw += self.buf
            self.buf = ""
            return False
        self.name += self.buf[:i]
        self.raw += self.buf[:i + 1]
        self.buf = self.buf[i + 1:]
        if not self.calls.start(self.name.strip()):
            return self.fail(self.buf)
        self.calls.args("{")
        self.stack, self.want_key, self.in_str, self.word = ["{"], True, False, ""
        self.comma = self.want_value = False  # a comma held; a key said, its value not
        self.state = "body"
        return True

    def s_body(self, final: bool) -> bool:
        out: list[str] = []
        while self.buf:
            if self.in_str:
                i = self.buf.find(QUOTE)
                k = i if i >= 0 else (len(self.buf) if final else held_from(self.buf, (QUOTE,)))
                if k:
                    out.append(json.dumps(self.buf[:k], ensure_ascii=False)[1:-1])
                if i < 0:
                    self.buf = self.buf[k:]
                    break
                out.append('"')
                self.buf, self.in_str = self.buf[i + len(QUOTE):], False
                continue
            if self.buf.startswith(QUOTE):
                self._item(out, '"')
                self.buf, self.in_str = self.buf[len(QUOTE):], True
                continue
            if QUOTE.startswith(self.buf) and not final:
                break
            ch, self.buf = self.buf[0], self.buf[1:]
            if ch not in "{}[],:" and not ch.isspace():
                self.word += ch
                continue
            if self.word.strip():
                key = self.want_key and self.stack[-1] == "{"
                # a bare number as float() spells it (`108.`) is a number, not a string
                self._item(out, json.dumps(self.word.strip()) if key
                           else json_value(self.word.strip(), "number"))
            self.word = ""
            if not ch.isspace() and self._punctuation(ch, out):
                self.calls.args("".join(out))
                self.state = "closing"
                return True
        self.calls.args("".join(out))
        return False

    def _item(self, out: list[str], text: str) -> None:
        """A key or value begins: the comma before it is written now, as one that a
        closing bracket follows is dropped."""
        if self.comma:
            out.append(",")
        self.comma, self.want_value = False, False
        out.append(text)

    def _punctuation(self, ch: str, out: list[str]) -> bool:
        """A structural character; True when it closes the call's body."""
        if ch in ",}]" and self.want_value:  # `key:` with no value: null
            self._item(out, "null")
        if ch == ",":
            self.comma, self.want_key = True, self.stack[-1] == "{"
            return False
        if ch == ":":
            out.append(ch)
            self.want_key, self.want_value = False, True
            return False
        if ch in "{[":
            self._item(out, ch)
            self.stack.append(ch)
            self.want_key = ch == "{"
            return False
        self.comma = False
        out.append(ch)
        self.stack.pop()
        return not self.stack


class Gemma4(ChatFormat):
    """Gemma 4's `<|tool_call>call:` calls and its thought channel."""

    name = "gemma4"
    patterns = ((r"<\|tool_call>call:",),)
    reasoning = GEMMA4_THOUGHT
    calls = Gemma4Calls

    def reasoning_in(self, template: str) -> str | None:
        return self.reasoning.name  # every Gemma 4 template may think
