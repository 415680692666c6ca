"""Tool calls whose parts are delimited by tags: DeepSeek V3.1's special tokens (the
arguments are the JSON between them), DeepSeek V3.2 / V4's DSML and Qwen3-Coder /
Qwen3.5's XML-like syntax, whose parameters become the arguments' JSON:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

    <｜DSML｜tool_calls>            (V3.2: function_calls)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A value is a string when the call says so (DSML's string="true") or the tool's schema
does (its parameter's type); a string streams, escaped as it comes. Another value is read
whole and taken as JSON where it parses, else as a string. The newlines that open and
close a Qwen value are the template's, not the value's.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping

from swaserve.server.chat_output import find_marker, held_from
from swaserve.server.tool_output import MarkedCalls

FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAMETER, END_FUNCTION, END_CALL = "</parameter>", "</function>", "</tool_call>"


def parameter_type(tools: Collection[str] | Mapping[str, dict], tool: str,
                   parameter: str) -> object:
    """The JSON schema type of a tool's parameter, where the tools came with schemas."""
    if not isinstance(tools, Mapping):
        return None
    schema = tools.get(tool) or {}
    prop = (schema.get("properties") or {}).get(parameter) or {}
    return prop.get("type") if isinstance(prop, dict) else None


def json_value(text: str) -> str:
    """A held value as JSON text: itself where it parses, else a JSON string of it."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


class TaggedParams(MarkedCalls):
    """What the tagged formats share: markers in turn, names up to a delimiter, and
    parameter values turned into the arguments' JSON as they stream."""

    value_ends: tuple[str, ...] = ()
    trims_newlines = False  # a value's opening and closing newline are the template's

    def _marker_next(self, final: bool, nexts: dict[str, str]) -> bool | None:
        """Whitespace, then one of `nexts` (-> its state); None when something else came."""
        s = self.buf.lstrip()
        for marker, state in nexts.items():
            if s.startswith(marker):
                self.raw += self.buf[:len(self.buf) - len(s) + len(marker)]
                self.buf, self.state = s[len(marker):], state
                return True
        if not s or (not final and any(m.startswith(s) for m in nexts)):
            return False
        return None

    def _upto(self, final: bool, end: str) -> str | None:
        """The text up to `end` (consumed), or None while it has not come."""
        i = self.buf.find(end)
        if i < 0:
            return None
        text = self.buf[:i]
        self.raw += self.buf[:i + len(end)]
        self.buf = self.buf[i + len(end):]
        return text

    def begin_param(self, pname: str, is_string: bool) -> None:
        """A parameter's key said; its value comes next."""
        self.calls.args(("{" if not self.params else ", ") + json.dumps(pname) + ": ")
        self.params += 1
        self.is_string = is_string
        if is_string:
            self.calls.args('"')
        self.state, self.value, self._lead = "value", "", self.trims_newlines

    def s_value(self, final: bool) -> bool:
        if self._lead:  # the template's newline after the parameter tag
            if not self.buf:
                return False
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
            self._lead = False
        ends = self.value_ends
        hit = find_marker(self.buf, ends)
        if hit is None:
            k = len(self.buf) if final else held_from(self.buf, ends)
            self._value(self.buf[:k])
            self.buf = self.buf[k:]
            return False
        i, marker = hit
        self._value(self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        self.calls.args('"' if self.is_string else json_value(self.value))
        self.state = "parameters"
        return True

    def _value(self, text: str) -> None:
        if self.is_string:
            if text:
                self.calls.args(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self.value += text

class Qwen3XmlCalls(TaggedParams):
    """Qwen3-Coder / Qwen3.5's calls, streamed."""

    opens = ("<tool_call>",)
    value_ends = ("\n" + END_PARAMETER, END_PARAMETER)
    trims_newlines = True

    def enter(self, marker: str) -> None:
        self.state = "function"

    def s_function(self, final: bool) -> bool:
        r = self._marker_next(final, {FUNCTION: "function_name"})
        return self.fail(self.buf) if r is None else r

    def s_function_name(self, final: bool) -> bool:
        name = self._upto(final, ">")
        if name is None:
            return False
        self.name = name.strip()
        if not self.calls.start(self.name):
            return self.fail(self.buf)
        self.state, self.params = "parameters", 0
        return True

    def s_parameters(self, final: bool) -> bool:
        r = self._marker_next(final, {PARAMETER: "parameter_name", END_FUNCTION: "closing"})
        if r is None:
            return self.fail(self.buf)
        if r and self.state == "closing":
            self.calls.args("}" if self.params else "{}")
        return r

    def s_parameter_name(self, final: bool) -> bool:
        pname = self._upto(final, ">")
        if pname is None:
            return False
        pname = pname.strip()
        self.begin_param(pname, parameter_type(self.calls.names, self.name, pname) == "string")
        return True

    def s_closing(self, final: bool) -> bool:
        return self.expect(final, END_CALL, "content") and self._closed()

    def _closed(self) -> bool:
        if self.state == "content":
            self._strip = True
        return True


DS = {k: f"<｜{v}｜>" for k, v in {
    "calls_begin": "tool▁calls▁begin", "calls_end": "tool▁calls▁end",
    "call_begin": "tool▁call▁begin", "call_end": "tool▁call▁end", "sep": "tool▁sep"}.items()}


DSML = "｜DSML｜"
DSML_OPENS = (f"<{DSML}tool_calls>", f"<{DSML}function_calls>")
INVOKE, END_INVOKE = f'<{DSML}invoke name="', f"</{DSML}invoke>"
DSML_PARAMETER, END_DSML_PARAMETER = f'<{DSML}parameter name="', f"</{DSML}parameter>"


class DeepSeekCalls(TaggedParams):
    """DeepSeek V3.1: `<｜tool▁calls▁begin｜>` then `<｜tool▁call▁begin｜>name<｜tool▁sep｜>
    {json}<｜tool▁call▁end｜>` per call, then `<｜tool▁calls▁end｜>`; and V3.2 / V4's DSML."""

    opens = (DS["calls_begin"], DS["call_begin"], *DSML_OPENS)
    special_opens = frozenset(DS.values())
    markers = frozenset(DS.values())
    value_ends = (END_DSML_PARAMETER,)

    def enter(self, marker: str) -> None:
        self.state = "calls"
        if marker == DS["call_begin"]:
            self.state, self.name = "name", ""
        elif marker in DSML_OPENS:
            self.state, self.dsml_end = "invokes", "</" + marker[1:]

    def s_invokes(self, final: bool) -> bool:
        r = self._marker_next(final, {INVOKE: "invoke_name", self.dsml_end: "content"})
        if r is None:
            return self.fail(self.buf)
        if r and self.state == "content":
            self.close_calls()
        return r

    def s_invoke_name(self, final: bool) -> bool:
        name = self._upto(final, '">')
        if name is None:
            return False
        self.name = name
        if not self.calls.start(name):
            return self.fail(self.buf)
        self.state, self.params = "parameters", 0
        return True

    def s_parameters(self, final: bool) -> bool:
        r = self._marker_next(final, {DSML_PARAMETER: "parameter_name", END_INVOKE: "invokes"})
        if r is None:
            return self.fail(self.buf)
        if r and self.state == "invokes":
            self.calls.args("}" if self.params else "{}")
        return r

    def s_parameter_name(self, final: bool) -> bool:
        head = self._upto(final, ">")  # P" string="true"
        if head is None:
            return False
        pname, _, attrs = head.partition('"')
        self.begin_param(pname, 'string="true"' in attrs)
        return True

    def s_calls(self, final: bool) -> bool:
        return self.expect_one(final, {DS["call_begin"]: "name", DS["calls_end"]: "end"})

    def expect_one(self, final: bool, nexts: dict[str, str]) -> bool:
        s = self.buf.lstrip()
        for marker, state in nexts.items():
            if s.startswith(marker):
                self.buf, self.state, self.name = s[len(marker):], state, ""
                if state == "end":
                    self.close_calls()
                return True
        if not s or (not final and any(m.startswith(s) for m in nexts)):
            if final:
                self.buf = ""
                self.close_calls()
            return False
        self.buf = s
        self.close_calls()
        return True

    def s_name(self, final: bool) -> bool:
        hit = find_marker(self.buf, (DS["sep"],))
        if hit is None:
            k = len(self.buf) if final else held_from(self.buf, (DS["sep"],))
            self.name += self.buf[:k]
            self.raw += self.buf[:k]
            self.buf = self.buf[k:]
            return False
        self.name += self.buf[:hit[0]]
        self.buf = self.buf[hit[0] + len(DS["sep"]):]
        if not self.calls.start(self.name.strip()):
            return self.fail(self.buf)
        self.state, self._lead = "args", True
        return True

    def s_args(self, final: bool) -> bool:
        if self._lead:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self._lead = False
        hit = find_marker(self.buf, (DS["call_end"],))
        if hit is None:  # trailing whitespace waits: it is dropped before the end marker
            k = len(self.buf) if final else min(held_from(self.buf, (DS["call_end"],)),
                                                len(self.buf.rstrip()))
            self.calls.args(self.buf[:k])
            self.buf = self.buf[k:]
            return False
        self.calls.args(self.buf[:hit[0]].rstrip())
        self.buf = self.buf[hit[0] + len(DS["call_end"]):]
        self.state = "calls"
        return True
