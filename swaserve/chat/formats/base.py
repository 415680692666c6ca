"""What a chat format is: one class per family's output syntax, carrying everything the
server needs to know of it (chat/registry.py registers them).

- its detection: `patterns` a chat template's text must have, and the reasoning block
  the template shows (`reasoning_in`);
- its reasoning block (`reasoning`, a `think.ThinkBlock`; a format that reads its own
  tokens, as Harmony does, is its own reasoning block in the registry);
- its markers and streaming call parser (`calls`: a `TextParser` class, whose `markers`
  are the special tokens it reads as structure);
- its call grammar (`call_grammar`): a required or named call in the syntax the model
  was trained on, where the syntax is JSON enough for one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import ClassVar, Protocol

from swaserve.chat.events import OutputParser, TextParser
from swaserve.chat.lark import Lark
from swaserve.chat.think import ThinkBlock
from swaserve.checkpoint.tokenizer import Tokenizer


class Reasoning(Protocol):
    """A reasoning block, named by its reasoning parser's name (`--reasoning-parser`)."""

    name: str
    reads_tokens: bool  # the block is the format's own token parser's (Harmony)

    def lead(self, lk: Lark, prompt: str) -> str:
        """The grammar of the block before a constrained answer; "" when it is not there."""

    def answer(self, lk: Lark, body: str) -> str:
        """A constrained answer's grammar `body` as the format frames it after the block."""

    def splitter(self, inner: TextParser, prompt: str) -> TextParser:
        """The text parser that takes the block out of the text, the rest to `inner`."""


class ChatFormat:
    """One family's chat format. Subclasses set `name` (its tool-call parser's name,
    `--tool-call-parser`), `patterns` and `calls`, and where the family has them its
    `reasoning` block and its call grammar (`has_call_grammar`, `call_grammar`)."""

    name: ClassVar[str]
    # alternatives, each a list of regular expressions all found in the template
    patterns: ClassVar[tuple[tuple[str, ...], ...]] = ()
    reasoning: ClassVar[ThinkBlock | None] = None  # the block its templates show
    calls: ClassVar[type | None] = None  # its streaming call parser: (tool_names, parallel)
    has_call_grammar: ClassVar[bool] = False
    reads_tokens: ClassVar[bool] = False  # it parses token ids itself (`token_parser`)

    def detect(self, template: str) -> tuple[str | None, str] | None:
        """(reasoning, tools) parser names where the template is written in this format."""
        if any(all(re.search(p, template) for p in alt) for alt in self.patterns):
            return self.reasoning_in(template), self.name
        return None

    def reasoning_in(self, template: str) -> str | None:
        """The reasoning parser of a template in this format: its block, where the template
        writes the block's opening tag."""
        r = self.reasoning
        return r.name if r is not None and r.open in template else None

    def call_parser(self, tool_names: Collection[str] | Mapping[str, dict],
                    parallel: bool) -> TextParser:
        """A streaming parser of this format's calls of `tool_names`."""
        if self.calls is None:
            raise ValueError(f"{self.name}: no call parser")
        return self.calls(tool_names, parallel)

    def token_parser(self, tokenizer: Tokenizer, *,
                     tool_names: Collection[str] | Mapping[str, dict] | None,
                     parallel_tool_calls: bool, prompt: str) -> OutputParser:
        """The whole output's parser, where the format reads token ids (`reads_tokens`)."""
        raise NotImplementedError(f"{self.name} reads text, not tokens")

    def constrains_calls(self, lk: Lark) -> bool:
        """Whether a call can be constrained to this format's syntax with this tokenizer."""
        return self.has_call_grammar

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        """One call of `name` with arguments of schema `args`, as the family's template
        writes it (`template`: its text, where it tells versions apart)."""
        raise NotImplementedError(f"no call grammar for tool format {self.name!r}")

    def repeated_calls(self, call: str) -> str:
        """Calls on offer beside an answer: one, or as many as the format writes in a row."""
        return call
