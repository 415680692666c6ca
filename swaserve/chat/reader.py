"""Token ids to the text a format's parser reads: special tokens that are the parser's
markers reach it as their text, other special tokens (eos) are left out, as
`skip_special_tokens` leaves them out, and the tokens between are decoded incrementally."""

from __future__ import annotations

from collections.abc import Sequence

from swaserve.chat.events import Event, TextParser
from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.detokenizer import IncrementalDetokenizer


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
