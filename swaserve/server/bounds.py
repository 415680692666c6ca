"""Bounds that keep one request's text and JSON from costing the server more than a refusal.

Text: no token of a vocabulary covers more characters of the text than its longest token
(`Tokenizer.longest_token`: a byte-level token's characters are its bytes, so it covers at
most that many characters), so a text tokenizes to at least len(text) / longest tokens. A
text longer than `longest × limit` characters therefore holds more than `limit` tokens and is
refused before the tokenizer sees it, which bounds its time and memory by the tokenizer's
cost of `longest × limit` characters, whatever the characters are. Where a tokenizer may drop
characters (a normalizer or pre-tokenizer that deletes whitespace, as BERT's do), the same
number of characters is a limit of this server rather than a proof.

JSON: a body's nested values are walked with a stack, never by recursion, so any depth the
body parser accepts is measured (and refused past `MAX_JSON_DEPTH`) without a RecursionError.
"""

from __future__ import annotations

from typing import Any

from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.server.errors import APIError

MAX_JSON_DEPTH = 128  # nested objects and arrays in a free-form JSON field (as chat_prompt's)


def max_chars(tok: Tokenizer, max_tokens: int) -> int:
    """The most characters a text of at most `max_tokens` tokens can have."""
    return tok.longest_token * max_tokens


def check_text(tok: Tokenizer, text: str, max_tokens: int, param: str) -> None:
    """A 400 (context_length_exceeded) when `text` has more characters than `max_tokens`
    tokens of this vocabulary cover: it cannot fit, and is refused without tokenizing."""
    check_chars(tok, len(text), max_tokens, param)


def check_chars(tok: Tokenizer, chars: int, max_tokens: int, param: str,
                what: str = "the context") -> None:
    """`check_text` of a length: `chars` characters against `max_tokens` tokens."""
    limit = max_chars(tok, max_tokens)
    if chars > limit:
        raise APIError(400, f"{param}: {chars} characters are more than {what} of "
                       f"{max_tokens} tokens can hold (no token of this model is longer than "
                       f"{tok.longest_token} characters): at most {limit}", param,
                       code="context_length_exceeded")


def text_chars(value: Any) -> int:
    """The characters of every string (keys included) in JSON-shaped `value`, without
    recursion: what a chat template can write into a prompt from it."""
    stack, total = [value], 0
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What is wrong with JSON-shaped `value` as a body's free-form field: nesting deeper
    than `max_depth` levels of objects and arrays, or a string or key holding a lone
    surrogate escape (it cannot be encoded into a prompt); None when nothing is."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not _encodes(node):
                return "must be valid Unicode text (it holds a lone surrogate escape)"
            continue
        if not isinstance(node, (dict, list, tuple)):
            continue
        if depth > max_depth:
            return f"nests deeper than {max_depth} levels"
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children)
    return None


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
