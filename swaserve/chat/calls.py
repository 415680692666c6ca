"""Tool calls in a model's output text, streamed: what every format's call parser shares
(formats/*.py hold the parsers themselves).

Each parser is a state machine over a text buffer. In content, text that might begin a
call marker is held only as long as it might; after a marker the call's name is read, then
its arguments stream as they come. A call names a declared tool, or it is not a call (the
text so far is content). With parallel_tool_calls off only the first call is said; later
ones are read and dropped. Whitespace after a call is dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from swaserve.chat.events import Event, find_marker, held_from
from swaserve.chat.json_calls import DONE, FAIL


def openai_call_id() -> str:
    """A call id as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


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
    close = ""  # the text that ends a call block (`s_closing`), where the format has one
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

    def s_closing(self, final: bool) -> bool:
        """After a call: its block's `close`, then content (its leading whitespace dropped)."""
        if self.expect(final, self.close, "content"):
            if self.state == "content":
                self._strip = True
            return True
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
