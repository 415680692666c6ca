"""Incremental detokenization: emit text as tokens arrive, never half a UTF-8 character."""

from __future__ import annotations

from swaserve.checkpoint.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Decodes a growing token list. Each new piece is decoded together with a few tokens of
    context before it, so tokenizers that treat a word start specially (SentencePiece's
    leading space) give the same text as one decode of the whole list."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if full.endswith("\ufffd"):  # an incomplete byte sequence: wait for more tokens
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
