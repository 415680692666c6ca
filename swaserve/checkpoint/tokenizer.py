"""Tokenizers: tokenizer.json via the `tokenizers` library, or converted once from GGUF
metadata (transformers' GGUF conversion, slow enough to do once) and cached as
tokenizer.json; with the model's chat templates and special tokens, found where
transformers finds them (tokenizer_files.py)."""

from __future__ import annotations

import logging
import os
import shutil
from functools import cached_property
from pathlib import Path

from swaserve.checkpoint.source import ModelLoadError, ModelSource
from swaserve.checkpoint.tokenizer_files import (
    find_chat_templates,
    generation_eos_ids,
    gguf_chat_templates,
    gguf_eos_ids,
    gguf_special_tokens,
    special_tokens,
)

log = logging.getLogger("swaserve")


class Tokenizer:
    """A `tokenizers.Tokenizer` with what chat needs beside it: the chat templates by name
    (`default`, `tool_use`, ...), the special tokens' strings by name (`bos_token`,
    `eos_token`, ...: what templates read), and the ids generation stops on."""

    def __init__(self, backend, *, chat_templates: dict[str, str] | None = None,
                 special_tokens: dict[str, str] | None = None,
                 bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()):
        self._tk = backend  # tokenizers.Tokenizer
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = dict(special_tokens or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}

    @property
    def chat_template(self) -> str | None:
        """The default chat template's text (None: the model names none)."""
        return self.chat_templates.get("default")

    @cached_property
    def longest_token(self) -> int:
        """The most characters of text one token can cover: its string's length (added
        tokens included). A byte-level token's string has a character per byte, so a
        multi-byte character counts once per byte: an upper bound, never under."""
        return max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL (`encode` holds it throughout: a long prompt would
        # stall the server's event loop and the engine thread); same ids
        batch = getattr(self._tk, "encode_batch_fast", self._tk.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar engines build their token tables from)."""
        return self._tk.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)


def _from_file(path: Path, source: ModelSource) -> Tokenizer:
    from tokenizers import Tokenizer as TK

    tk = TK.from_file(str(path))
    cfg = source.model_config()
    eos = cfg.eos_token_ids
    if source.fmt == "hf":
        templates = find_chat_templates(source.path)
        tokens = special_tokens(source.path)
        eos += tuple(i for i in generation_eos_ids(source.path) if i not in eos)
    else:
        meta = source.gguf_meta or {}
        templates = gguf_chat_templates(meta)
        tokens = gguf_special_tokens(meta, tk.id_to_token)
        eos += tuple(i for i in gguf_eos_ids(meta) if i not in eos)
    return Tokenizer(tk, chat_templates=templates, special_tokens=tokens,
                     bos_token_id=cfg.bos_token_id, eos_token_ids=eos)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The model's tokenizer, or None for a directory without tokenizer files."""
    if source.fmt == "hf":
        tj = source.path / "tokenizer.json"
        if tj.exists():
            return _from_file(tj, source)
        return None
    cache = source.cache_dir() / "tokenizer"
    tj = cache / "tokenizer.json"
    if not tj.exists():
        log.info("converting the GGUF tokenizer (once; cached in %s)", cache)
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            try:
                hf_tok = AutoTokenizer.from_pretrained(str(source.path.parent),
                                                       gguf_file=source.path.name)
            except Exception:  # noqa: BLE001
                # AutoTokenizer reads the model's config first, which transformers cannot
                # do for every GGUF (gpt-oss's rope scaling); the tokenizer itself needs
                # only the tokenizer.ggml.* metadata
                hf_tok = PreTrainedTokenizerFast.from_pretrained(str(source.path.parent),
                                                                 gguf_file=source.path.name)
        except Exception as e:  # noqa: BLE001 - conversion failures are many-shaped
            raise ModelLoadError(f"{source.path}: cannot build a tokenizer from the GGUF "
                                 f"metadata ({type(e).__name__}: {e})") from e
        _bos_as_the_gguf_says(hf_tok, source.gguf_meta or {})
        tmp = cache.with_name(f"tokenizer.tmp{os.getpid()}")
        hf_tok.save_pretrained(str(tmp))
        if cache.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(cache)
    return _from_file(tj, source)


def _bos_as_the_gguf_says(hf_tok, meta: dict) -> None:
    """Prepend BOS on encode where the GGUF says `tokenizer.ggml.add_bos_token`, as
    llama.cpp does: transformers' conversion leaves it out for some architectures
    (gemma4), and a Gemma model without its BOS reads a text it was never trained on."""
    bos, bos_id = hf_tok.bos_token, hf_tok.bos_token_id
    if not meta.get("tokenizer.ggml.add_bos_token") or bos is None or bos_id is None:
        return
    if hf_tok("x")["input_ids"][:1] == [bos_id]:
        return
    from tokenizers.processors import TemplateProcessing

    hf_tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
