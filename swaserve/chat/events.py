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

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.detokenizer import IncrementalDetokenizer

REASONING_PARSERS = ("harmony", "qwen3", "deepseek_r1", "gemma4", "mistral")
TOOL_PARSERS = ("harmony", "hermes", "qwen3_xml", "llama3_json", "mistral", "deepseek", "gemma4",
                "json")


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


class TokenTextParser:
    """An OutputParser over a TextParser: special tokens that are the text parser's markers
    reach it as their text, other special tokens are dropped, ordinary tokens are decoded
    incrementally (a special token starts a new decode, as it splits the text)."""

    def __init__(self, tokenizer: Tokenizer, text_parser: TextParser):
        self.tok = tokenizer
        self.text = text_parser
        self.reasoning_tokens = 0
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self._marker_of: dict[int, str | None] = {}

    def _marker(self, token_id: int) -> str | None:
        if token_id not in self._marker_of:
            text = self.tok.id_to_token(token_id)
            self._marker_of[token_id] = text if text in self.text.markers else None
        return self._marker_of[token_id]

    def feed(self, token_ids: Sequence[int]) -> list[Event]:
        events: list[Event] = []
        for t in token_ids:
            before = self.text.in_reasoning
            if t in self.tok.special_ids:
                self._detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
                marker = self._marker(t)
                if marker is not None:
                    events += self.text.feed(marker)
            else:
                delta = self._detok.add(t)
                if delta:
                    events += self.text.feed(delta)
            if before or self.text.in_reasoning:
                self.reasoning_tokens += 1
        return events

    def finish(self) -> list[Event]:
        return self.text.finish()


def make_output_parser(tokenizer: Tokenizer, *, reasoning: str | None, tools: str | None,
                       tool_names: Collection[str] | Mapping[str, dict] | None,
                       parallel_tool_calls: bool = True, prompt: str = "") -> OutputParser:
    """The parser of one completion. `reasoning`/`tools` name the formats (REASONING_PARSERS,
    TOOL_PARSERS); `tool_names` are the declared tools (a mapping gives their parameters'
    JSON schemas, which type qwen3_xml's values); None means no tools are in play and
    nothing is a call. `prompt` is the rendered prompt: its end says whether the output
    starts inside a think block or a Harmony message."""
    from swaserve.server.harmony_output import HarmonyParser
    from swaserve.server.reasoning_output import ThinkSplitter
    from swaserve.server.tool_output import make_tool_text_parser

    if reasoning not in (None, *REASONING_PARSERS):
        raise ValueError(f"unknown reasoning parser {reasoning!r}")
    if tools not in (None, *TOOL_PARSERS):
        raise ValueError(f"unknown tool parser {tools!r}")
    if "harmony" in (reasoning, tools):
        return HarmonyParser(tokenizer, tool_names=tool_names,
                             parallel_tool_calls=parallel_tool_calls, prompt=prompt)
    inner: TextParser = PlainText()
    if tools is not None and tool_names is not None:
        inner = make_tool_text_parser(tools, tool_names, parallel_tool_calls)
    if reasoning is not None:
        inner = ThinkSplitter(inner, prompt, reasoning)
    return TokenTextParser(tokenizer, inner)


_PICKS = [  # (patterns all in the template, (reasoning, tools)); the first that fits wins
    ((r"<\|channel\|>",), ("harmony", "harmony")),
    ((r"<\|tool_call>call:",), ("gemma4", "gemma4")),
    ((r"<tool_call>", r"<function=", r"<parameter="), ("qwen3", "qwen3_xml")),
    ((r"<tool_call>[ \t]*(\\n|\n)\s*\{",), ("qwen3", "hermes")),  # a JSON object inside
    ((r"tool▁calls▁begin|｜DSML｜",), (None, "deepseek")),
    ((r"\[TOOL_CALLS\]", r"\[THINK\]"), ("mistral", "mistral")),
    ((r"\[TOOL_CALLS\]",), (None, "mistral")),
    ((r"<\|python_tag\|>|<\|eom_id\|>",), (None, "llama3_json")),
    ((r"<\|start_header_id\|>", r'"parameters"'), (None, "llama3_json")),
]


def default_parsers(template_source: str | None) -> tuple[str | None, str | None]:
    """(reasoning, tools) for a chat template's text where its syntax says so unambiguously;
    (None, "json") otherwise (the built-in template, an unknown one)."""
    if not template_source:
        return None, "json"
    if "<arg_key>" in template_source:
        return None, None  # GLM's own call syntax, which no parser here reads
    for patterns, (reasoning, tools) in _PICKS:
        if all(re.search(p, template_source) for p in patterns):
            if reasoning == "qwen3" and "<think>" not in template_source:
                reasoning = None  # Qwen2.5 and Hermes: tool calls, no thinking
            if tools == "deepseek" and "<think>" in template_source:
                reasoning = "deepseek_r1"
            return reasoning, tools
    if "<think>" in template_source and "<｜Assistant｜>" in template_source:
        return "deepseek_r1", "json"  # the R1 distills: no tool syntax of their own
    return None, "json"
