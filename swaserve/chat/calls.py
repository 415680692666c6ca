"""Tool calls in a model's output text, streamed: the JSON families (`hermes`, `llama3_json`,
`mistral`, `json`); the tag-delimited ones (`qwen3_xml`, `deepseek`) live in
tool_output_xml.py.

Each parser is a state machine over a text buffer. In content, text that might begin a
call marker is held only as long as it might; after a marker the call's name is read, then
its arguments stream as they come. A call names a declared tool, or it is not a call (the
text so far is content). With parallel_tool_calls off only the first call is said; later
ones are read and dropped. Whitespace after a call is dropped.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Collection

from swaserve.server.chat_output import Event, TextParser, find_marker, held_from
from swaserve.server.json_calls import DONE, FAIL, CallsReader, JsonValueScan


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates check ids are nine letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class CallLog:
    """The calls of one completion: indices, ids, and the parallel_tool_calls rule."""

    def __init__(self, out: list[Event], tool_names: Collection[str], parallel: bool,
                 new_id=openai_call_id):
        self.out, self.names, self.parallel, self.new_id = out, tool_names, parallel, new_id
        self.said = 0  # calls said
        self.read = 0  # calls read (said or dropped)
        self._live = False

    def start(self, name: str) -> bool:
        """A call of `name` begins; False when it names no declared tool."""
        if name not in self.names:
            return False
        self.read += 1
        self._live = self.parallel or self.said == 0
        if self._live:
            self.out.append(Event("call", name=name, call_id=self.new_id(), index=self.said))
            self.said += 1
        return True

    def args(self, text: str) -> None:
        if self._live and text:
            self.out.append(Event("arguments", text, index=self.said - 1))


class MarkedCalls:
    """The shared machine: content until one of `opens`, then the subclass's states."""

    opens: tuple[str, ...] = ()
    special_opens: frozenset[str] = frozenset()  # opens that are special tokens: never content
    bare_at_start = ""  # first characters that make the whole output a call
    markers: frozenset[str] = frozenset()
    in_reasoning = False

    def __init__(self, tool_names: Collection[str], parallel: bool):
        self.out: list[Event] = []
        self.calls = CallLog(self.out, tool_names, parallel, self.new_call_id)
        self.buf = ""
        self.state = "start"
        self.raw = ""  # the text of the block being read, content if it is not a call
        self._read_at_open = 0  # calls read before the block: none since means no call
        self._strip = False

    new_call_id = staticmethod(openai_call_id)

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(True)
        if self.state not in ("start", "content") and self.calls.read == self._read_at_open:
            self.content(self.raw)  # an unfinished block that never became a call
        self.buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        out = list(self.out)
        self.out.clear()
        return out

    def _run(self, final: bool) -> None:
        while getattr(self, "s_" + self.state)(final):
            pass

    def content(self, text: str) -> None:
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
        if text:
            self.out.append(Event("content", text))

    def s_start(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        if s[0] in self.bare_at_start:
            self.buf = s
            self.open_block("")
            return True
        self.state = "content"
        return True

    def s_content(self, final: bool) -> bool:
        if not self.buf:
            return False
        hit = find_marker(self.buf, self.opens)
        if hit is None:
            k = len(self.buf) if final else held_from(self.buf, self.opens)
            self.content(self.buf[:k])
            self.buf = self.buf[k:]
            return False
        i, marker = hit
        self.content(self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        self.open_block(marker)
        return True

    def open_block(self, marker: str) -> None:
        self.raw = "" if marker in self.special_opens else marker
        self._read_at_open = self.calls.read
        self.enter(marker)

    def enter(self, marker: str) -> None:
        raise NotImplementedError

    def fail(self, rest: str) -> bool:
        """The block is not (or no longer) a call: content if no call came of it."""
        if self.calls.read == self._read_at_open:
            self.content(self.raw)
        self.buf = rest
        self.state = "content"
        return True

    def close_calls(self) -> None:
        self.state, self._strip = "content", True

    def read_json(self, reader, on_done) -> bool:
        """Feeds the buffer to a CallsReader; on_done() -> the next state."""
        for i, ch in enumerate(self.buf):
            self.raw += ch
            r = reader.push(ch)
            if r == FAIL:
                return self.fail(self.buf[i + 1:])
            if r == DONE:
                self.buf = self.buf[i + 1:]
                on_done()
                return True
        self.buf = ""
        return False

    def expect(self, final: bool, marker: str, then: str) -> bool:
        """After a call: whitespace, then `marker` (dropped) or anything else (content)."""
        s = self.buf.lstrip()
        if not s:
            if final:
                self.buf = ""
            return False
        if s.startswith(marker):
            self.buf = s[len(marker):]
            self.state = then
        elif marker.startswith(s) and not final:
            return False
        else:
            self.buf = s
            self.close_calls()
        return True


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

    def s_closing(self, final: bool) -> bool:
        if self.expect(final, self.close, "content"):
            if self.state == "content":
                self._strip = True
            return True
        return False


FENCE_LANGS = ("", "json", "tool_code", "tool_call", "python")


class JsonFallbackCalls(HermesCalls):
    """The built-in template's formats (tools.py's parse_auto): a bare JSON call or list of
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


class Llama3Calls(MarkedCalls):
    """Llama 3.1-3.3: `<|python_tag|>` or a bare object at the output's start, then
    `{"name": ..., "parameters": {...}}`, more of them after `;`."""

    opens = ("<|python_tag|>",)
    special_opens = frozenset(opens)
    bare_at_start = "{"
    markers = frozenset(opens)

    def enter(self, marker: str) -> None:
        self.state = "block"
        self.reader = CallsReader(self.calls.names, self.calls.start, self.calls.args,
                                  lists=False)

    def s_block(self, final: bool) -> bool:
        return self.read_json(self.reader, lambda: setattr(self, "state", "sep"))

    def s_sep(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            if final:
                self.buf = ""
            return False
        if s[0] == ";":
            self.buf = s[1:]
            self.open_block("")
        else:
            self.buf = s
            self.close_calls()
        return True


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


def make_tool_text_parser(name: str, tool_names, parallel: bool) -> TextParser:
    """The text parser of tool format `name` (chat_output.TOOL_PARSERS but harmony)."""
    from swaserve.server.tool_output_gemma4 import Gemma4Calls
    from swaserve.server.tool_output_xml import DeepSeekCalls, Qwen3XmlCalls

    classes = {"hermes": HermesCalls, "json": JsonFallbackCalls, "llama3_json": Llama3Calls,
               "mistral": MistralCalls, "deepseek": DeepSeekCalls, "qwen3_xml": Qwen3XmlCalls,
               "gemma4": Gemma4Calls}
    return classes[name](tool_names, parallel)
