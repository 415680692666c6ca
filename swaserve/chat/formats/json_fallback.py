"""The fallback format (`json`): the built-in template's call formats (chat/tools.py's
parse_auto), and what a template of no known syntax gets: a bare JSON call or list of
calls at the output's start, a ```json fence around one, or a `<tool_call>` block. The
DeepSeek-R1 distills write `<think>` reasoning and no call syntax of their own."""

from __future__ import annotations

from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.formats.hermes import HermesCalls
from swaserve.chat.think import R1_THINK

FENCE_LANGS = ("", "json", "tool_code", "tool_call", "python")


class JsonFallbackCalls(HermesCalls):
    """The built-in template's formats (chat/tools.py's parse_auto): a bare JSON call or list of
    calls at the output's start, a ```json fence around one, or a `<tool_call>` block."""

    opens = ("<tool_call>", "```")
    bare_at_start = "{["

    def enter(self, marker: str) -> None:
        super().enter(marker)
        self.close = {"```": "```", "<tool_call>": "</tool_call>"}.get(marker, "")
        if marker == "```":
            self.state, self.lang = "lang", ""

    def s_lang(self, final: bool) -> bool:
        while self.buf and self.buf[0].isalnum() or self.buf[:1] == "_":
            self.lang += self.buf[0]
            self.raw += self.buf[0]
            self.buf = self.buf[1:]
        if not self.buf:
            return False
        if self.lang not in FENCE_LANGS:
            return self.fail(self.buf)
        self.state = "block"
        return True

    def s_closing(self, final: bool) -> bool:
        if not self.close:  # a bare call: the output is the call
            self.close_calls()
            return True
        return super().s_closing(final)


class Json(ChatFormat):
    """The format of last resort: JSON calls bare, fenced or in `<tool_call>` blocks."""

    name = "json"
    patterns = ((),)  # every template: the format of last resort
    reasoning = R1_THINK
    calls = JsonFallbackCalls

    def reasoning_in(self, template: str) -> str | None:
        return super().reasoning_in(template) if "<｜Assistant｜>" in template else None
