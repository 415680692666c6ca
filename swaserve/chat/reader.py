"""Token ids to the text a format's parser reads, decoded here for every format: special
tokens that are the parser's markers reach it as their text, other special tokens (eos)
are left out, as `skip_special_tokens` leaves them out, and the tokens between are decoded
incrementally, each run on its own (a special token splits the text)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from swaserve.chat.events import Event, TextParser
from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.detokenizer import IncrementalDetokenizer


class SegmentReader:
    """One completion's tokens as text pieces: `marker_of(id)` is the text of a token the
    parser reads as structure (None: not one); such a token, or any special token, ends the
    run of text before it."""

    def __init__(self, tokenizer: Tokenizer, marker_of: Callable[[int], str | None]):
        self.tok = tokenizer
        self.marker_of = marker_of
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)

    def read(self, token_id: int) -> tuple[str | None, str]:
        """(the token's marker, or None; the new text it decodes to, possibly "")."""
        marker = self.marker_of(token_id)
        if marker is not None or token_id in self.tok.special_ids:
            self._detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
            return marker, ""
        return None, self._detok.add(token_id)


class TokenTextParser:
    """An OutputParser over a TextParser: special tokens that are the text parser's markers
    reach it as their text, other special tokens are dropped, ordinary tokens are decoded
    incrementally (a special token starts a new decode, as it splits the text)."""

    def __init__(self, tokenizer: Tokenizer, text_parser: TextParser):
        self.tok = tokenizer
        self.text = text_parser
        self.reasoning_tokens = 0
        self._reader = SegmentReader(tokenizer, self._marker)
        self._marker_of: dict[int, str | None] = {}

    def _marker(self, token_id: int) -> str | None:
        """A special token's text where the text parser reads it as a marker."""
        if token_id not in self.tok.special_ids:
            return None
        if token_id not in self._marker_of:
            text = self.tok.id_to_token(token_id)
            self._marker_of[token_id] = text if text in self.text.markers else None
        return self._marker_of[token_id]

    def feed(self, token_ids: Sequence[int]) -> list[Event]:
        events: list[Event] = []
        for t in token_ids:
            before = self.text.in_reasoning
            marker, text = self._reader.read(t)
            if marker is not None or text:
                events += self.text.feed(marker if marker is not None else text)
            if before or self.text.in_reasoning:
                self.reasoning_tokens += 1
        return events

    def finish(self) -> list[Event]:
        return self.text.finish()
