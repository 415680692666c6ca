"""What a tokenizer reads beside tokenizer.json, found where transformers finds it: the
chat templates by name, the special tokens' strings, and the extra ids generation stops on.

Chat templates of an HF directory: `chat_template.jinja` (named `default`) and
`additional_chat_templates/<name>.jinja`; only when there are none, tokenizer_config.json's
`chat_template`, a string (`default`) or a list of `{"name", "template"}`. A GGUF keeps
them in its metadata: `tokenizer.chat_template` (`default`) and
`tokenizer.chat_template.<name>`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("swaserve")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# GGUF metadata key of each special token's id (llama.cpp spells "separator" this way)
_GGUF_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "sep_token": "seperator_token_id",
                   "pad_token": "padding_token_id", "mask_token": "mask_token_id"}
_GGUF_TEMPLATE = "tokenizer.chat_template"


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when it is missing or unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); ignored", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def find_chat_templates(directory: Path) -> dict[str, str]:
    """An HF directory's chat templates by name ({} when it has none)."""
    found = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        found["default"] = default.read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            found[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if found:
        return found
    return templates_of(_read_json(directory / "tokenizer_config.json").get("chat_template"))


def templates_of(value: Any) -> dict[str, str]:
    """tokenizer_config.json's `chat_template` by name: a string is the `default`."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value
                if isinstance(t, dict) and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str)}
    return {}


def gguf_chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    """A GGUF's chat templates by name, from its metadata."""
    found = {}
    if isinstance(meta.get(_GGUF_TEMPLATE), str):
        found["default"] = meta[_GGUF_TEMPLATE]
    for key, value in meta.items():
        if key.startswith(_GGUF_TEMPLATE + ".") and isinstance(value, str):
            found[key.removeprefix(_GGUF_TEMPLATE + ".")] = value
    return found


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken
    object (`{"content": ...}`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: Path) -> dict[str, str]:
    """An HF directory's special tokens by name, from tokenizer_config.json, overridden by
    special_tokens_map.json (as transformers reads them); unset ones are left out."""
    found = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = _read_json(directory / name)
        for key in SPECIAL_TOKEN_NAMES:
            if key in data:
                found[key] = _token_text(data[key])
    return {k: v for k, v in found.items() if v is not None}


def gguf_special_tokens(meta: dict[str, Any],
                        id_to_token: Callable[[int], str | None]) -> dict[str, str]:
    """A GGUF's special tokens by name: the texts of the ids its metadata names."""
    found = {}
    for name, key in _GGUF_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        text = id_to_token(int(token_id)) if isinstance(token_id, int) else None
        if text is not None:
            found[name] = text
    return found


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id`s: the turn ends generation stops on beside
    config.json's (gpt-oss lists its tool call end, `<|call|>`, only there)."""
    eos = _read_json(directory / "generation_config.json").get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def gguf_eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """A GGUF's end-of-turn and end-of-message ids, which llama.cpp also stops on."""
    ids = (meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
