"""Reasoning in `<think>`…`</think>` (Qwen3, DeepSeek-R1 and its distills; Gemma 4's
`<|channel>thought`…`<channel|>` and Magistral's `[THINK]`…`[/THINK]` alike): the text
inside is reasoning, the text after goes on to the tool parser (or is content).

Where the output starts is read from the prompt's end, as llama.cpp reads it: a prompt
that ends with `<think>` (R1's templates, Qwen3.5 with thinking on) leaves the output inside
the block until `</think>`; a closed empty block (Qwen3 with enable_thinking false) or none
leaves it outside, where a `<think>` at the output's start opens one. Whitespace that opens
the reasoning or the text after it is dropped. A block whose family calls tools only after
it ends at a call's opening (`call_opens`), where tools are in play: a model that starts a
call without closing the block has left it.
"""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.chat.events import Event, TextParser, find_marker, held_from
from swaserve.chat.lark import ANY_TEXT, Lark

THINK, END_THINK = "<think>", "</think>"


def prompt_opens_think(prompt: str, opening: str = THINK) -> bool:
    """Whether the rendered prompt leaves the output inside a think block."""
    return prompt.rstrip().endswith(opening)


@dataclass(frozen=True)
class ThinkBlock:
    """A format's reasoning block: `name` is its reasoning parser's name; text between
    `open` and `close` is reasoning; `specials` are the special tokens among them (read as
    structure). `constrained`: a JSON answer's grammar lets the block come first."""

    name: str
    open: str
    close: str
    specials: tuple[str, ...]
    constrained: bool = False
    call_opens: tuple[str, ...] = ()  # tool parsers' openings that end the block (Qwen3)
    reads_tokens = False  # the format's text parser reads it (not a parser of its own)

    def lead(self, lk: Lark, prompt: str) -> str:
        """What the output may start with before a constrained answer: the block (free
        text), or nothing where it is not constrained or its markers are not tokens here."""
        if not self.constrained or not lk.has_tokens(self.open, self.close):
            return ""
        block = f"{ANY_TEXT} {lk.mark(self.close)} /[ \\n]*/"
        if prompt_opens_think(prompt, self.open):  # the template opened the block
            return block
        return f"({lk.mark(self.open)} {block})?"

    def answer(self, lk: Lark, body: str) -> str:
        """A constrained answer after the block: as it is."""
        return body

    def splitter(self, inner: TextParser, prompt: str) -> TextParser:
        """The text parser that takes the block out of the output, the rest to `inner`."""
        return ThinkSplitter(inner, prompt, self)


QWEN3_THINK = ThinkBlock("qwen3", THINK, END_THINK, (THINK, END_THINK), constrained=True,
                         call_opens=("<tool_call>",))
R1_THINK = ThinkBlock("deepseek_r1", THINK, END_THINK, (THINK, END_THINK), constrained=True)


class ThinkSplitter:
    """Reasoning out of a think block; the rest to `inner`. `block` names the block's tags
    (Gemma 4 writes `<|channel>thought`…`<channel|>`)."""

    def __init__(self, inner: TextParser, prompt: str = "", block: ThinkBlock = QWEN3_THINK):
        self.inner = inner
        self.open, self.close, specials = block.open, block.close, block.specials
        self.markers = inner.markers | set(specials)
        # the call openings that end the block, kept for the tool parser
        opens = getattr(inner, "opens", ())
        self.ends = (self.close, *(m for m in block.call_opens if m in opens))
        self._state = "think" if prompt_opens_think(prompt, self.open) else "start"
        self._buf = ""
        self._strip = True  # the next part's leading whitespace is dropped

    @property
    def in_reasoning(self) -> bool:
        return self._state == "think"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True) + self.inner.finish()

    def _lstrip(self) -> bool:
        """Drops the part's leading whitespace; False while nothing else has come."""
        if self._strip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip = False
        return True

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            if self._state == "start":
                if not self._lstrip():
                    break
                if self._buf.startswith(self.open):
                    self._buf = self._buf[len(self.open):]
                    self._state, self._strip = "think", True
                    continue
                if self.open.startswith(self._buf) and not final:
                    break
                self._state = "after"
            elif self._state == "think":
                if not self._lstrip():
                    break
                hit = find_marker(self._buf, self.ends)
                if hit is not None:
                    out.append(Event("reasoning", self._buf[:hit[0]]))
                    at = hit[0] + (len(hit[1]) if hit[1] == self.close else 0)
                    self._buf = self._buf[at:]
                    self._state, self._strip = "after", True
                    continue
                k = len(self._buf) if final else held_from(self._buf, self.ends)
                if k:
                    out.append(Event("reasoning", self._buf[:k]))
                self._buf = self._buf[k:]
                break
            else:
                if not self._lstrip():
                    break
                out += self.inner.feed(self._buf)
                self._buf = ""
        return out
