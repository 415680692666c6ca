"""Real tokenizers for tests, built offline from the vocabularies quicktok-v1 ships: o200k
with the Harmony specials (gpt-oss), Qwen3 and Llama 3.1; and tiny byte-level ones with the
Mistral, DeepSeek and Gemma 4 special tokens, whose real vocabularies no package ships.
`write_tokenizer(family, directory)` writes tokenizer.json and tokenizer_config.json, as a
checkpoint directory holds them; `load_tokenizer(family)` gives swaserve's Tokenizer."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from importlib import metadata
from pathlib import Path

from swaserve.checkpoint.tokenizer import Tokenizer

O200K_PAT = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
             r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"""
             r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|"""
             r""" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen's added tokens that HF marks non-special: they survive skip_special_tokens
QWEN_TEXT_TOKENS = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
# family -> (vocab file, special file, pattern, eos tokens)
BPE_FAMILIES = {
    "gpt-oss": ("o200k.vocab", "o200k_harmony.special", O200K_PAT,
                ["<|return|>", "<|call|>"]),
    "qwen3": ("qwen3.vocab", "qwen3.special", QWEN_PAT, ["<|im_end|>", "<|endoftext|>"]),
    "llama3": ("llama3.vocab", "llama3.special", LLAMA3_PAT,
               ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]),
}
WORD_FAMILIES = {  # family -> (special tokens, eos)
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                 "[CALL_ID]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]", "[THINK]", "[/THINK]"], ["</s>"]),
    "deepseek": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                  "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                  "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"],
                 ["<｜end▁of▁sentence｜>"]),
    "gemma4": (["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|tool_call>",
                "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<|tool_response>",
                "<tool_response|>"], ["<turn|>", "<eos>"]),
}


def _data_dir() -> Path:
    import quicktok

    return Path(quicktok.__file__).parent / "data"


def read_vocab(name: str) -> list[tuple[bytes, int]]:
    """quicktok's .vocab: u32 count, then (u16 length, bytes, u32 rank) per token."""
    raw = (_data_dir() / name).read_bytes()
    (count,), pos, out = struct.unpack_from("<I", raw), 4, []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", raw, pos)
        token = raw[pos + 2:pos + 2 + n]
        (rank,) = struct.unpack_from("<I", raw, pos + 2 + n)
        out.append((token, rank))
        pos += 6 + n
    return out


def read_specials(name: str) -> list[tuple[int, str]]:
    """quicktok's .special: u32 count, then (u32 id, u16 length, text) per token."""
    raw = (_data_dir() / name).read_bytes()
    (count,), pos, out = struct.unpack_from("<I", raw), 4, []
    for _ in range(count):
        tid, n = struct.unpack_from("<IH", raw, pos)
        out.append((tid, raw[pos + 6:pos + 6 + n].decode()))
        pos += 6 + n
    return out


def write_tiktoken_file(vocab: str, path: Path) -> Path:
    """The vocabulary as a .tiktoken file (base64 token, space, rank per line)."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(read_vocab(vocab),
                                                                    key=lambda x: x[1])]
    path.write_text("\n".join(lines) + "\n")
    return path


def _specials(family: str) -> list[tuple[int, str]]:
    specials = read_specials(BPE_FAMILIES[family][1])
    if family == "llama3":  # quicktok's list is Llama 3.0's; 3.1 names two reserved ids
        renamed = {128008: "<|eom_id|>", 128010: "<|python_tag|>"}
        specials = [(i, renamed.get(i, t)) for i, t in specials]
    return sorted(specials)


def _build_bpe(family: str, directory: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab, _, pattern, _ = BPE_FAMILIES[family]
    specials = _specials(family)
    tiktoken_file = write_tiktoken_file(vocab, directory / f"{family}.tiktoken")
    first = len(read_vocab(vocab))
    # the converter numbers the extra tokens from the vocabulary's end: fill any gap
    names = {i: t for i, t in specials}
    extra = [names.get(i, f"<|reserved_{i}|>") for i in range(first, specials[-1][0] + 1)]
    tk = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=pattern,
                           extra_special_tokens=extra).converted()
    tiktoken_file.unlink()
    if family == "qwen3":
        data = json.loads(tk.to_str())
        for t in data["added_tokens"]:
            t["special"] = t["content"] not in QWEN_TEXT_TOKENS
        directory.joinpath("tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    else:
        tk.save(str(directory / "tokenizer.json"))


def _build_words(family: str, directory: Path) -> None:
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, pre_tokenizers

    specials, _ = WORD_FAMILIES[family]
    # one token per byte-level character: any text round-trips, like a real byte BPE
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet), start=len(specials))}
    for i, s in enumerate(specials):
        vocab[s] = i
    tk = TK(models.BPE(vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.save(str(directory / "tokenizer.json"))


def write_tokenizer(family: str, directory: str | os.PathLike) -> Path:
    """tokenizer.json and tokenizer_config.json of `family` ("gpt-oss", "qwen3", "llama3",
    "mistral", "deepseek", "gemma4") in `directory`; built once per quicktok version and copied from a
    cache under the user's cache directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    version = metadata.version("quicktok-v1")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swaserve-tests" \
        / f"tokenizers-{version}" / family
    if not (cache / "tokenizer.json").exists():
        tmp = cache.with_name(f"{family}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        (_build_bpe if family in BPE_FAMILIES else _build_words)(family, tmp)
        eos = (BPE_FAMILIES[family][3] if family in BPE_FAMILIES else WORD_FAMILIES[family][1])
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": eos[0], "additional_special_tokens": eos[1:]}))
        try:
            tmp.rename(cache)
        except OSError:  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(cache / name, directory / name)
    return directory / "tokenizer.json"


_LOADED: dict[str, Tokenizer] = {}


def load_tokenizer(family: str, directory: str | os.PathLike | None = None) -> Tokenizer:
    """swaserve's Tokenizer of `family` (cached per process)."""
    if family not in _LOADED:
        from tokenizers import Tokenizer as TK

        cache = Path(directory) if directory else Path(os.environ.get(
            "XDG_CACHE_HOME", Path.home() / ".cache")) / "swaserve-tests" / "tok-load" / family
        path = write_tokenizer(family, cache)
        tk = TK.from_file(str(path))
        eos = (BPE_FAMILIES[family][3] if family in BPE_FAMILIES else WORD_FAMILIES[family][1])
        _LOADED[family] = Tokenizer(tk, eos_token_ids=tuple(tk.token_to_id(t) for t in eos))
    return _LOADED[family]
