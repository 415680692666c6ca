"""The chat formats by name, and what one completion's parser is made of.

A format (formats/base.py's `ChatFormat`) is one class in its own module in formats/; it
is registered by its line in `FORMATS` (the order the CLI and errors list the names) and
its place in `DETECTION` (the order a chat template is matched in). Its reasoning block is
found by its name in `REASONING`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from swaserve.chat.events import OutputParser, PlainText, TextParser
from swaserve.chat.formats.base import ChatFormat, Reasoning
from swaserve.chat.formats.deepseek import DeepSeek
from swaserve.chat.formats.gemma4 import GEMMA4_THOUGHT, Gemma4
from swaserve.chat.formats.harmony import Harmony
from swaserve.chat.formats.hermes import Hermes
from swaserve.chat.formats.json_fallback import Json
from swaserve.chat.formats.llama3_json import Llama3Json
from swaserve.chat.formats.mistral import MISTRAL_THINK, Mistral
from swaserve.chat.formats.qwen3_xml import Qwen3Xml
from swaserve.chat.reader import TokenTextParser
from swaserve.chat.think import QWEN3_THINK, R1_THINK
from swaserve.checkpoint.tokenizer import Tokenizer

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    Harmony(), Hermes(), Qwen3Xml(), Llama3Json(), Mistral(), DeepSeek(), Gemma4(), Json())}
# a template is matched against these in turn: the first whose syntax it has wins
DETECTION = ("harmony", "gemma4", "qwen3_xml", "hermes", "deepseek", "mistral", "llama3_json",
             "json")
REASONING: dict[str, Reasoning] = {r.name: r for r in (
    FORMATS["harmony"], QWEN3_THINK, R1_THINK, GEMMA4_THOUGHT, MISTRAL_THINK)}
# template text of a call syntax no format here reads (GLM's): no parsers at all
UNREAD = ("<arg_key>",)

REASONING_PARSERS = tuple(REASONING)
TOOL_PARSERS = tuple(FORMATS)


def default_parsers(template_source: str | None) -> tuple[str | None, str | None]:
    """(reasoning, tools) for a chat template's text where its syntax says so unambiguously;
    (None, "json") otherwise (the built-in template, an unknown one)."""
    if not template_source:
        return None, "json"
    if any(marker in template_source for marker in UNREAD):
        return None, None
    for name in DETECTION:
        found = FORMATS[name].detect(template_source)
        if found is not None:
            return found
    return None, "json"


def make_output_parser(tokenizer: Tokenizer, *, reasoning: str | None, tools: str | None,
                       tool_names: Collection[str] | Mapping[str, dict] | None,
                       parallel_tool_calls: bool = True, prompt: str = "") -> OutputParser:
    """The parser of one completion. `reasoning`/`tools` name the formats (REASONING_PARSERS,
    TOOL_PARSERS); `tool_names` are the declared tools (a mapping gives their parameters'
    JSON schemas, which type qwen3_xml's values); None means no tools are in play and
    nothing is a call. `prompt` is the rendered prompt: its end says whether the output
    starts inside a think block or a Harmony message."""
    if reasoning not in (None, *REASONING):
        raise ValueError(f"unknown reasoning parser {reasoning!r}")
    if tools not in (None, *FORMATS):
        raise ValueError(f"unknown tool parser {tools!r}")
    block = REASONING[reasoning] if reasoning is not None else None
    fmt = FORMATS[tools] if tools is not None else None
    for whole in (fmt, block):  # a format that reads its own tokens parses all of them
        if whole is not None and whole.reads_tokens:
            return whole.token_parser(tokenizer, tool_names=tool_names,
                                      parallel_tool_calls=parallel_tool_calls, prompt=prompt)
    inner: TextParser = PlainText()
    if fmt is not None and tool_names is not None:
        inner = fmt.call_parser(tool_names, parallel_tool_calls)
    if block is not None:
        inner = block.splitter(inner, prompt)
    return TokenTextParser(tokenizer, inner)
