"""gpt-oss's Harmony format, read as a machine over its special tokens:

    <|start|>ROLE<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>json]<|message|>BODY<|end|>

(`<|call|>` or `<|return|>` end a message too; a recipient may also follow the role). The
output of a prompt that ends with `<|start|>assistant` starts at `<|channel|>`. Channel
`analysis` is reasoning, `final` content; `commentary` to `functions.NAME` is a call of a
declared tool whose body is its arguments, and commentary without a recipient is content
(a preamble). Messages to other recipients (built-in tools, undeclared functions) are
not the user's: they are left out.

Harmony is both a reasoning and a tool format: its reasoning is the analysis channel, and
its parser reads the whole output's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from swaserve.chat.calls import CallLog
from swaserve.chat.events import Event, OutputParser, TextParser
from swaserve.chat.formats.base import ChatFormat
from swaserve.chat.lark import ANY_TEXT, Lark, txt
from swaserve.chat.reader import SegmentReader
from swaserve.checkpoint.tokenizer import Tokenizer

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
STRUCTURE = (START, CHANNEL, CONSTRAIN, MESSAGE, *ENDS)
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in STRUCTURE) + ")")
_RECIPIENT = re.compile(r"\bto=(\S+)")
_GRAMMAR_TOKENS = (CHANNEL, MESSAGE, "<|end|>", START)  # a grammar's markers, as tokens


class HarmonyParser:
    """The OutputParser of Harmony output (reasoning and tool calls both)."""

    def __init__(self, tokenizer: Tokenizer, *, tool_names: Collection[str] | None,
                 parallel_tool_calls: bool = True, prompt: str = ""):
        self.tok = tokenizer
        self.reasoning_tokens = 0
        self._structure = {tokenizer.token_to_id(t): t for t in STRUCTURE}
        self._structure.pop(None, None)
        self._out: list[Event] = []
        self._calls = CallLog(self._out, tool_names or (), parallel_tool_calls)
        self._tools = tool_names
        self._reader = SegmentReader(tokenizer, self._structure.get)
        self._state = "role"  # role | header | constrain | body | idle
        self._fields = {"role": "assistant", "header": "", "constrain": ""}
        self._kind: str | None = None  # the body's event kind, None when left out
        self._header_tokens = 0
        self._prime(prompt)

    def _prime(self, prompt: str) -> None:
        """Starts where the prompt's last message leaves off (the header it began)."""
        i = prompt.rfind(START)
        if i < 0:
            return
        self._special(START)
        for part in _SPLIT.split(prompt[i + len(START):]):
            if part in STRUCTURE:
                self._special(part)
            elif part:
                self._text(part)
        self._out.clear()

    def _special(self, token: str) -> None:
        if token == START:
            self._state, self._header_tokens = "role", 0
            self._fields = {"role": "", "header": "", "constrain": ""}
        elif token == CHANNEL and self._state in ("role", "idle", "header"):
            if self._state == "idle":
                self._fields, self._header_tokens = {"role": "assistant", "header": "",
                                                     "constrain": ""}, 0
            self._state = "header"
        elif token == CONSTRAIN and self._state in ("role", "header"):
            self._state = "constrain"
        elif token == MESSAGE and self._state != "body":
            self._open_body()
        elif token in ENDS:
            self._state, self._kind = "idle", None

    def _open_body(self) -> None:
        header = self._fields["role"] + " " + self._fields["header"]
        words = self._fields["header"].split()
        channel = words[0] if words else ""
        m = _RECIPIENT.search(header)
        recipient = m.group(1) if m else None
        self._state, self._kind = "body", None
        if recipient is None:
            self._kind = "reasoning" if channel == "analysis" else "content"
        elif (recipient.startswith("functions.") and self._tools is not None
              and self._calls.start(recipient[len("functions."):])):
            self._kind = "arguments"

    def _text(self, text: str) -> None:
        if self._state == "body":
            if self._kind == "arguments":
                self._calls.args(text)
            elif self._kind is not None:
                self._out.append(Event(self._kind, text))
        elif self._state in self._fields:
            self._fields[self._state] += text

    def feed(self, token_ids: Sequence[int]) -> list[Event]:
        for t in token_ids:
            in_analysis = self._kind == "reasoning"
            special, text = self._reader.read(t)
            if special is not None:
                self._special(special)
            elif text:
                self._text(text)
            if self._state in ("role", "header", "constrain") or special == MESSAGE:
                self._header_tokens += 1
                if special == MESSAGE and self._kind == "reasoning":
                    self.reasoning_tokens += self._header_tokens
            elif in_analysis or self._kind == "reasoning":
                self.reasoning_tokens += 1
        out = list(self._out)
        self._out.clear()
        return out

    def finish(self) -> list[Event]:
        return []


class Harmony(ChatFormat):
    """The Harmony format, as its tool format and as its reasoning block alike."""

    name = "harmony"
    patterns = ((r"<\|channel\|>",),)
    has_call_grammar = True
    reads_tokens = True

    def reasoning_in(self, template: str) -> str | None:
        return self.name

    def token_parser(self, tokenizer: Tokenizer, *, tool_names: Collection[str] | None,
                     parallel_tool_calls: bool, prompt: str) -> OutputParser:
        return HarmonyParser(tokenizer, tool_names=tool_names,
                             parallel_tool_calls=parallel_tool_calls, prompt=prompt)

    def constrains_calls(self, lk: Lark) -> bool:
        return lk.has_tokens(*_GRAMMAR_TOKENS)

    def call_grammar(self, lk: Lark, name: str, args: dict, template: str) -> str:
        # the recipient in the header, as gpt-oss's template writes calls
        return " ".join([txt(f" to=functions.{name}"), lk.mark(CHANNEL),
                         txt("commentary json"), lk.mark(MESSAGE), lk.json(args)])

    def lead(self, lk: Lark, prompt: str) -> str:
        """An analysis message before a constrained answer, where the markers are tokens."""
        if not lk.has_tokens(*_GRAMMAR_TOKENS):
            return ""
        return (f"({lk.mark(CHANNEL)} {txt('analysis')} {lk.mark(MESSAGE)} "
                f"{ANY_TEXT} {lk.mark('<|end|>', START)} {txt('assistant')})?")

    def answer(self, lk: Lark, body: str) -> str:
        """A constrained answer is the final channel's message."""
        return f"{lk.mark(CHANNEL)} {txt('final')} {lk.mark(MESSAGE)} {body}"

    def splitter(self, inner: TextParser, prompt: str) -> TextParser:
        raise NotImplementedError("harmony reads tokens: see token_parser")
