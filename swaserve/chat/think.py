"""Reasoning in `<think>`…`</think>` (Qwen3, DeepSeek-R1 and its distills; Gemma 4's
`<|channel>thought`…`<channel|>` and Magistral's `[THINK]`…`[/THINK]` alike): the text
inside is reasoning, the text after goes on to the tool parser (or is content).

Where the output starts is read from the prompt's end, as llama.cpp reads it: a prompt
that ends with `<think>` (R1's templates, Qwen3.5 with thinking on) leaves the output inside
the block until `</think>`; a closed empty block (Qwen3 with enable_thinking false) or none
leaves it outside, where a `<think>` at the output's start opens one. Whitespace that opens
the reasoning or the text after it is dropped.
"""

from __future__ import annotations

from swaserve.server.chat_output import Event, TextParser, find_marker, held_from

THINK, END_THINK = "<think>", "</think>"
# parser -> (the block's opening, its end, the special tokens among them)
BLOCKS = {"qwen3": (THINK, END_THINK, (THINK, END_THINK)),
          "deepseek_r1": (THINK, END_THINK, (THINK, END_THINK)),
          "gemma4": ("<|channel>thought", "<channel|>", ("<|channel>", "<channel|>")),
          "mistral": ("[THINK]", "[/THINK]", ("[THINK]", "[/THINK]"))}


def prompt_opens_think(prompt: str, opening: str = THINK) -> bool:
    """Whether the rendered prompt leaves the output inside a think block."""
    return prompt.rstrip().endswith(opening)


class ThinkSplitter:
    """Reasoning out of a think block; the rest to `inner`. `kind` names the block's tags
    (BLOCKS: Gemma 4 writes `<|channel>thought`…`<channel|>`)."""

    def __init__(self, inner: TextParser, prompt: str = "", kind: str = "qwen3"):
        self.inner = inner
        self.open, self.close, specials = BLOCKS[kind]
        self.markers = inner.markers | set(specials)
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
                hit = find_marker(self._buf, (self.close,))
                if hit is not None:
                    out.append(Event("reasoning", self._buf[:hit[0]]))
                    self._buf = self._buf[hit[0] + len(self.close):]
                    self._state, self._strip = "after", True
                    continue
                k = len(self._buf) if final else held_from(self._buf, (self.close,))
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
