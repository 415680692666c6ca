"""Tokenizers: tokenizer.json via the `tokenizers` library, or converted once from GGUF
metadata (transformers' GGUF conversion, slow enough to do once) and cached as
tokenizer.json."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from swaserve.checkpoint.source import ModelLoadError, ModelSource

log = logging.getLogger("swaserve")


class Tokenizer:
    def __init__(self, backend, *, chat_template: str | None = None,
                 bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()):
        self._tk = backend  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}

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


def _from_file(path: Path, config_path: Path | None, source: ModelSource) -> Tokenizer:
    from tokenizers import Tokenizer as TK

    tk = TK.from_file(str(path))
    template = None
    if config_path is not None and config_path.exists():
        try:
            template = json.loads(config_path.read_text()).get("chat_template")
        except (OSError, json.JSONDecodeError):
            template = None
    if template is None and source.gguf_meta is not None:
        template = source.gguf_meta.get("tokenizer.chat_template")
    tmpl_file = source.directory / "chat_template.jinja"
    if template is None and source.fmt == "hf" and tmpl_file.exists():
        template = tmpl_file.read_text()
    cfg = source.model_config()
    return Tokenizer(tk, chat_template=template, bos_token_id=cfg.bos_token_id,
                     eos_token_ids=cfg.eos_token_ids)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The model's tokenizer, or None for a directory without tokenizer files."""
    if source.fmt == "hf":
        tj = source.path / "tokenizer.json"
        if tj.exists():
            return _from_file(tj, source.path / "tokenizer_config.json", source)
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
        tmp = cache.with_name(f"tokenizer.tmp{os.getpid()}")
        hf_tok.save_pretrained(str(tmp))
        if cache.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(cache)
    return _from_file(tj, cache / "tokenizer_config.json", source)
