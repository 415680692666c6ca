"""DeepSeek's calls: V3.1's special tokens (the arguments are the JSON between them) and
V3.2 / V4's DSML, whose parameters become the arguments' JSON (tagged.py); R1's `<think>`
reasoning where the template shows it:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜DSML｜tool_calls>            (V3.2: function_calls)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>
"""

from __future__ import annotations

from swaserve.chat.events import find_marker, held_from
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.lark import Lark, txt
from swaserve.chat.tagged import TaggedParams, is_typed, parameter_type
from swaserve.chat.think import R1_THINK

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
        if not self.named(name):
            return self.fail(self.buf)
        self.state = "parameters"
        return True

    def s_parameters(self, final: bool) -> bool:
        r = self._marker_next(final, {DSML_PARAMETER: "parameter_name", END_INVOKE: "invokes"})
        if r is None:
            return self.fail(self.buf)
        if r and self.state == "invokes":
            self.end_call()
        return r

    def s_parameter_name(self, final: bool) -> bool:
        head = self._upto(final, ">")  # P" string="true"
        if head is None:
            return False
        pname, _, attrs = head.partition('"')
        kind = parameter_type(self.calls.names, self.name, pname)
        # the schema's type, where it has one, outweighs the call's string attribute
        said = 'string="true"' in attrs
        self.begin_param(pname, kind == "string" or (said and not is_typed(kind)), kind)
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


class DeepSeek(ChatFormat):
    """DeepSeek's V3.1 call tokens and V3.2 / V4 DSML, R1's `<think>` where shown."""

    name = "deepseek"
    patterns = ((r"tool▁calls▁begin|｜DSML｜",),)
    reasoning = R1_THINK
    calls = DeepSeekCalls
    has_call_grammar = True

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        return " ".join([lk.mark("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), txt(name),
                         lk.mark("<｜tool▁sep｜>"), lk.json(args),
                         lk.mark("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")])
