"""Qwen3-Coder / Qwen3.5's calls, whose parameters become the arguments' JSON (tagged.py),
with Qwen3's `<think>` reasoning where the template shows it:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.tagged import TaggedParams, parameter_type
from swaserve.chat.think import QWEN3_THINK

FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAMETER, END_FUNCTION, END_CALL = "</parameter>", "</function>", "</tool_call>"


class Qwen3XmlCalls(TaggedParams):
    """Qwen3-Coder / Qwen3.5's calls, streamed."""

    opens = ("<tool_call>",)
    value_ends = ("\n" + END_PARAMETER, END_PARAMETER)
    trims_newlines = True
    close = END_CALL

    def enter(self, marker: str) -> None:
        self.state = "function"

    def s_function(self, final: bool) -> bool:
        r = self._marker_next(final, {FUNCTION: "function_name"})
        return self.fail(self.buf) if r is None else r

    def s_function_name(self, final: bool) -> bool:
        name = self._upto(final, ">")
        if name is None:
            return False
        if not self.named(name.strip()):
            return self.fail(self.buf)
        self.state = "parameters"
        return True

    def s_parameters(self, final: bool) -> bool:
        r = self._marker_next(final, {PARAMETER: "parameter_name", END_FUNCTION: "closing"})
        if r is None:
            return self.fail(self.buf)
        if r and self.state == "closing":
            self.end_call()
        return r

    def s_parameter_name(self, final: bool) -> bool:
        pname = self._upto(final, ">")
        if pname is None:
            return False
        pname = pname.strip()
        kind = parameter_type(self.calls.names, self.name, pname)
        self.begin_param(pname, kind == "string", kind)
        return True


class Qwen3Xml(ChatFormat):
    """Qwen3-Coder / Qwen3.5's XML-like calls, Qwen3's `<think>` where shown."""

    name = "qwen3_xml"
    patterns = ((r"<tool_call>", r"<function=", r"<parameter="),)
    reasoning = QWEN3_THINK
    calls = Qwen3XmlCalls
