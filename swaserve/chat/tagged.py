"""Tool calls whose parameters are delimited by tags (Qwen3-Coder / Qwen3.5's XML-like
syntax, DeepSeek V3.2 / V4's DSML: formats/qwen3_xml.py, formats/deepseek.py), turned into
the arguments' JSON as they stream.

A value is a string when the tool's schema says so (its parameter's type), or, where the
schema gives no type, when the call does (DSML's string="true"); a string streams, escaped
as it comes. Another value is read whole and taken as JSON where it parses; where the
schema types it otherwise, as the Python literal the Qwen templates write (True, None,
{'a': 1}) or a number (`2.`); else as a string. The newlines that open and close a Qwen
value are the template's, not the value's.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection, Mapping

from swaserve.chat.calls import MarkedCalls
from swaserve.chat.events import find_marker, held_from


def parameter_type(tools: Collection[str] | Mapping[str, dict], tool: str,
                   parameter: str) -> object:
    """The JSON schema type of a tool's parameter, where the tools came with schemas."""
    if not isinstance(tools, Mapping):
        return None
    schema = tools.get(tool) or {}
    prop = (schema.get("properties") or {}).get(parameter) or {}
    return prop.get("type") if isinstance(prop, dict) else None


def is_typed(kind: object) -> bool:
    """Whether a schema type is one a string value is not (a list of types: none string)."""
    if isinstance(kind, list):
        return bool(kind) and "string" not in kind
    return kind in ("boolean", "number", "integer", "object", "array", "null")


def json_value(text: str, kind: object = None) -> str:
    """A held value as JSON text: itself where it parses; where `kind` (its schema type)
    is not string, the Python literal or number it spells; else a JSON string of it."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        pass
    if is_typed(kind):
        value = _literal(text.strip())
        if value is not None:
            return value
    return json.dumps(text, ensure_ascii=False)


def _literal(text: str) -> str | None:
    """JSON text of a Python literal or a number such as `2.`; None when it is neither."""
    try:
        return json.dumps(ast.literal_eval(text), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:  # a float() spelling JSON refuses (`2.`, `.5`)
        number = float(text)
    except ValueError:
        return None
    if number != number or number in (float("inf"), float("-inf")):
        return None
    return json.dumps(int(number) if number.is_integer() and "." not in text else number)


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

    def named(self, name: str) -> bool:
        """A call's name has come: False when it names no declared tool. The call is said
        at its first parameter or its end, so that a body that does not parse is no call."""
        self.name, self.params = name, 0
        return name in self.calls.names

    def end_call(self) -> None:
        """The call's closing tag: said now if it had no parameter, and its arguments closed."""
        if not self.params:
            self.calls.start(self.name)
        self.calls.args("}" if self.params else "{}")

    def begin_param(self, pname: str, is_string: bool, kind: object = None) -> None:
        """A parameter's key said; its value (of schema type `kind`) comes next."""
        if not self.params:
            self.calls.start(self.name)
        self.calls.args(("{" if not self.params else ", ") + json.dumps(pname) + ": ")
        self.params += 1
        self.is_string, self.kind = is_string, kind
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
        self.calls.args('"' if self.is_string else json_value(self.value, self.kind))
        self.state = "parameters"
        return True

    def _value(self, text: str) -> None:
        if self.is_string:
            if text:
                self.calls.args(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self.value += text
