"""What one chat completion's output tokens say: reasoning, content and tool calls, as
events that stream while the tokens arrive.

The parsers read token ids, not the engine's text (which skips special tokens): a special
token that is structure for the format (Harmony's `<|channel|>`, Mistral's `[TOOL_CALLS]`)
is recognised as a token, the rest is decoded incrementally and parsed as text, and other
special tokens (eos) are left out, as `skip_special_tokens` leaves them out.

The contract every parser keeps: feeding a token sequence one token at a time, in any cuts,
or all at once gives the same events once adjacent events of one kind (and one call) are
merged (`merge_events`); a call's `arguments` fragments concatenate to its arguments' JSON
(a well-formed call's: arguments stream as written, so a cut-short one keeps what came).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol


@dataclass(frozen=True)
class Event:
    """One thing the output says. `call` opens call `index` (its name and id); the
    `arguments` events after it carry fragments of that call's arguments JSON."""

    kind: Literal["reasoning", "content", "call", "arguments"]
    text: str = ""
    name: str | None = None
    call_id: str | None = None
    index: int = 0


class OutputParser(Protocol):
    """Turns one completion's output tokens into events as they arrive."""

    reasoning_tokens: int  # output tokens counted as reasoning so far

    def feed(self, token_ids: Sequence[int]) -> list[Event]:
        """What can be said about the new tokens now (text that may be a marker is held)."""

    def finish(self) -> list[Event]:
        """The end of the output: what was held, said."""


class TextParser(Protocol):
    """A parser of decoded text: the layer under a token parser."""

    markers: frozenset[str]  # special tokens whose text this parser reads as structure
    in_reasoning: bool  # inside reasoning now (for counting reasoning tokens)

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def merge_events(events: Sequence[Event]) -> list[Event]:
    """Adjacent events of one kind (and one call) joined: the form two parses compare in."""
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if (prev is not None and e.kind == prev.kind and e.kind != "call"
                and e.index == prev.index):
            out[-1] = replace(prev, text=prev.text + e.text)
        elif e.kind != "call" and not e.text:
            continue
        else:
            out.append(e)
    return out


def held_from(buf: str, markers: Collection[str]) -> int:
    """Where the longest end of `buf` that could begin one of `markers` starts (len(buf)
    when none could): text before it can be said now, the rest must wait."""
    for start in range(max(0, len(buf) - max(map(len, markers)) + 1), len(buf)):
        tail = buf[start:]
        if any(m.startswith(tail) for m in markers):
            return start
    return len(buf)


def find_marker(buf: str, markers: Collection[str]) -> tuple[int, str] | None:
    """The first of `markers` in `buf`: (where, which), or None."""
    best = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


class PlainText:
    """All text is content (no tools in play, or no tool parser)."""

    markers: frozenset[str] = frozenset()
    in_reasoning = False

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []
