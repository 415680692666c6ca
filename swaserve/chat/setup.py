"""One model's chat setup: its chat template, the stop token every chat gets and the formats
its output is read in; and how a rendered chat is tokenized. The server's state and the
offline API (`LLM.chat`) both build it here, so they prompt and parse a chat alike."""

from __future__ import annotations

from typing import NamedTuple

from swaserve.chat.registry import default_parsers
from swaserve.chat.template import GEMMA_END_OF_TURN, ChatTemplate
from swaserve.checkpoint.tokenizer import Tokenizer


class ChatSetup(NamedTuple):
    """A model's chat template, the stop token of every chat (Gemma's `<end_of_turn>`
    under the built-in template, else None) and the formats (reasoning, tool calls) its
    template's syntax says its output is written in (chat/registry.py)."""

    template: ChatTemplate
    end_of_turn: int | None
    reasoning: str | None
    tools: str | None


def chat_setup(tokenizer: Tokenizer, chat_template: str | None = None) -> ChatSetup:
    """The chat setup of a tokenizer: `chat_template` (a template's text) replaces the
    model's own templates; with neither, the built-in Gemma template is used."""
    source = chat_template or tokenizer.chat_templates or None
    template = ChatTemplate(source, tokenizer.special_tokens)
    end_of_turn = tokenizer.token_to_id(GEMMA_END_OF_TURN) if template.builtin else None
    reasoning, tools = default_parsers(None if template.builtin else template.source_for(True))
    return ChatSetup(template, end_of_turn, reasoning, tools)


def starts_with_bos(tokenizer: Tokenizer, text: str) -> bool:
    """Whether a rendered chat already begins with the BOS token (most templates write
    it), so tokenizing it must not add another."""
    tok = tokenizer
    bos = tok.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else None
    return bool(bos) and text.startswith(bos)
