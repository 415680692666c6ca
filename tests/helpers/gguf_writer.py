"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from a tiny HF
model of transformers' own classes and a small tokenizer: the same metadata keys, tensor
names (gguf's own name map) and layouts (Llama's permuted q/k rows, gpt-oss's split expert
stacks, Gemma 3's 1 + w norms, Llama 3's and Gemma 4's rope_freqs; Gemma 4's own keys in
gguf_gemma4.py), tensors of the types asked for.

`write_gguf` leaves the HF model holding exactly what the file holds (the dequantized
values, put back in HF's layout), so that transformers on that model is the reference for
swaserve loading the file. Types the gguf package cannot quantize (the K-quants, IQ4_NL,
IQ4_XS) are written as random blocks with small scales."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tests.helpers import gguf_gemma4 as gemma4

# the pre-tokenizer regexes of the tokenizers llama.cpp names by `tokenizer.ggml.pre`
SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
MULTILINGUAL = ("Hello, wörld! Ça va? Grüße aus Köln. 你好，世界。 Привет, мир! こんにちは。 "
                "안녕하세요 🚀🦙 x+y=12345 don't I'll\n\ttabs  and   spaces")
_GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gpt-oss": "GPT_OSS",
              "gemma3": "GEMMA3", "gemma4": "GEMMA4"}


@dataclass
class Vocab:
    """A tokenizer (tokenizers.Tokenizer) and what the converter writes of it: `model` is
    "gpt2" (byte-level BPE, merges written; `pre` names its pre-tokenizer), "llama"
    (SentencePiece BPE with byte fallback: scores and token types instead of merges) or
    "gemma4" (the same pieces, scores and types, and the merges too)."""
    tokenizer: object
    model: str
    pre: str
    bos: int
    eos: int
    add_bos: bool
    prefix_space: bool = True

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def add_to(self, w) -> None:
        import json

        import gguf

        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        tokens = sorted(vocab, key=vocab.get)
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                   if t.special}
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(tokens)
        if self.model == "gpt2":
            w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                               for t in tokens])
            merges = json.loads(self.tokenizer.to_str())["model"]["merges"]
            w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        else:  # a SentencePiece model's pieces: scores by merge rank, byte pieces typed
            kinds = {"<unk>": gguf.TokenType.UNKNOWN}
            w.add_token_types([kinds.get(t, gguf.TokenType.CONTROL) if t in special
                               else gguf.TokenType.BYTE if _BYTE_PIECE.fullmatch(t)
                               else gguf.TokenType.NORMAL for t in tokens])
            w.add_token_scores([0.0 if t in special or _BYTE_PIECE.fullmatch(t) else -float(i)
                                for i, t in enumerate(tokens)])
            w.add_unk_token_id(vocab["<unk>"])
            if self.model == "gemma4":
                merges = json.loads(self.tokenizer.to_str())["model"]["merges"]
                w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
            w.add_add_space_prefix(self.prefix_space)
        w.add_bos_token_id(self.bos)
        w.add_eos_token_id(self.eos)
        w.add_add_bos_token(self.add_bos)


_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
_CORPUS = [MULTILINGUAL, "The quick brown fox jumps over the lazy dog 0123456789.",
           "Über größere Straßen fährt man schnell. 我们在北京工作。 Добрый день!"] * 40


def _add_bos(tk, bos: str) -> None:
    from tokenizers import processors

    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))])


def byte_bpe_vocab(pre: str, specials: list[str], bos: str, eos: str, add_bos: bool,
                   size: int = 400) -> Vocab:
    """A byte-level BPE trained on multilingual text, pre-tokenized like the models that
    `pre` names; `specials` follow the learned tokens (as in Llama 3, Qwen, gpt-oss)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=size - len(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_special_tokens(specials)
    if add_bos:
        _add_bos(tk, bos)
    return Vocab(tk, "gpt2", pre, tk.token_to_id(bos), tk.token_to_id(eos), add_bos)


def sentencepiece_vocab(size: int = 400, prefix_space: bool = True) -> Vocab:
    """A SentencePiece-style BPE like Llama 2's and Mistral's: <unk>, <s>, </s>, the 256
    byte pieces, then pieces learned on multilingual text with "▁" for spaces; a space
    before the text unless `prefix_space` is False (Gemma's)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    space = pre_tokenizers.Metaspace(replacement="▁", split=False,
                                     prepend_scheme="first" if prefix_space else "never")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = space
    trained.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=size - 259, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = head + sorted(learned["vocab"], key=learned["vocab"].get)
    tk = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)},
                              [tuple(m) if not isinstance(m, str) else tuple(m.split(" "))
                               for m in learned["merges"]],
                              unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = space
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * prefix_space)
    tk.add_special_tokens(head[:3])
    _add_bos(tk, "<s>")
    return Vocab(tk, "llama", "default", 1, 2, True, prefix_space)


# -- tensors ---------------------------------------------------------------------------------

_SCALE_OFFSETS = {  # byte offsets of a block's float16 scales (d, dmin) for random blocks
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
    "IQ4_XS": (0,)}


def encode(arr: np.ndarray, qtype, seed: int) -> np.ndarray:
    """arr in GGML type `qtype`: quantized by the gguf package where it can, else random
    blocks of that type with small finite scales (the caller reads back what they hold)."""
    import gguf

    try:
        return gguf.quants.quantize(arr.astype(np.float32), qtype)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = arr.size // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype.name]:
        d = (rng.random(n_blocks) * 4e-5 + 1e-5).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*arr.shape[:-1], arr.shape[-1] // block * size)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its RoPE (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


Part = tuple[str, np.ndarray]
Inverse = Callable[[list[np.ndarray]], np.ndarray]


def _convert(arch: str, cfg, name: str, w: np.ndarray, names, fuse: bool
             ) -> tuple[list[Part], Inverse]:
    """The GGUF tensors the converter writes for one HF tensor, and how to get the HF tensor
    back from them."""
    base, _, suffix = name.rpartition(".")
    if arch == "gemma4" and gemma4.gguf_name(name) is not None:
        return [(gemma4.gguf_name(name), w)], lambda a: a[0]
    if name.endswith("self_attn.sinks"):
        return [(names.get_name(name) + ".weight", w)], lambda a: a[0]
    if ".experts." in name:  # gpt-oss: [E, in, out]-shaped HF stacks
        return _experts(name, w, names, fuse)
    gname = names.get_name(base) + "." + suffix
    if arch == "gemma3" and name.endswith("norm.weight"):
        return [(gname, w + 1.0)], lambda a: a[0] - 1.0
    if arch == "llama" and ("q_proj" in name or "k_proj" in name):
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        return [(gname, _permute(w, heads))], lambda a: _unpermute(a[0], heads)
    return [(gname, w)], lambda a: a[0]


def _experts(name: str, w: np.ndarray, names, fuse: bool) -> tuple[list[Part], Inverse]:
    layer = name.split(".")[2]
    if name.endswith("down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", w.swapaxes(1, 2))], lambda a: a[0].swapaxes(1, 2)
    if name.endswith("down_proj_bias"):
        return [(f"blk.{layer}.ffn_down_exps.bias", w)], lambda a: a[0]
    kind = "bias" if name.endswith("_bias") else "weight"
    t = w if kind == "bias" else w.swapaxes(1, 2)  # [E, 2 * out, (in)], gate/up interleaved
    gate, up = t[:, ::2], t[:, 1::2]

    def interleave(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        out = np.empty((g.shape[0], 2 * g.shape[1], *g.shape[2:]), dtype=g.dtype)
        out[:, ::2], out[:, 1::2] = g, u
        return out if kind == "bias" else out.swapaxes(1, 2)

    if fuse:
        return ([(f"blk.{layer}.ffn_gate_up_exps.{kind}", np.concatenate([gate, up], axis=1))],
                lambda a: interleave(*np.split(a[0], 2, axis=1)))
    return ([(f"blk.{layer}.ffn_gate_exps.{kind}", gate), (f"blk.{layer}.ffn_up_exps.{kind}", up)],
            lambda a: interleave(a[0], a[1]))


def _metadata(w, arch: str, cfg, window: int | None) -> None:
    """The hyperparameters llama.cpp's TextModel.set_gguf_parameters and each family's
    converter write."""
    import gguf

    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    local = (getattr(cfg, "rope_parameters", None) or {}).get("sliding_attention")
    if local is not None:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)
    if arch in ("gpt-oss", "gemma3") or window:
        w.add_sliding_window(window or cfg.sliding_window)
    if arch == "gemma4":
        gemma4.add_metadata(w, cfg)
    if arch == "gpt-oss":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)


def _rope_freqs(cfg) -> np.ndarray | None:
    """Llama 3's RoPE scaling as the converter writes it: a factor per frequency."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type") != "llama3":
        return None
    dim, base = cfg.head_dim, rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, model, arch: str, vocab: Vocab | None = None,
               qtype: Callable[[str], object] | None = None, *, window: int | None = None,
               fuse_gate_up: bool = False, seed: int = 0) -> None:
    """`model` (a transformers CausalLM) as a GGUF of architecture `arch` at `path`, its
    matrices in `qtype(gguf name)`'s type (F32 when None; norms and 1-D tensors stay F32 as
    the converter keeps them); `window` writes `attention.sliding_window` for a family
    whose GGUF has none of its own (Mistral). The model then holds the file's values."""
    import gguf

    cfg = model.config
    if arch == "gemma4":  # read the generic keys as the converter does, from the top level
        cfg.allow_global_per_layer_attribute_access = True
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_GGUF_ARCH[arch]], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg, window)
    if vocab is not None:
        vocab.add_to(w)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    freqs = gemma4.rope_freqs(cfg) if arch == "gemma4" else _rope_freqs(cfg)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    restored = {}
    for i, (name, arr) in enumerate(state.items()):
        parts, inverse = _convert(arch, cfg, name, arr, names, fuse_gate_up)
        held = []
        for gname, t in parts:
            kind = gguf.GGMLQuantizationType.F32
            if qtype is not None and t.ndim > 1 and not gname.endswith("norm.weight"):
                kind = qtype(gname)
            data = encode(t, kind, seed + i)
            w.add_tensor(gname, data, raw_dtype=kind)
            held.append(gguf.quants.dequantize(data, kind).reshape(t.shape))
        restored[name] = inverse(held)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in restored:
                p.copy_(torch.from_numpy(np.ascontiguousarray(restored[name])))


def split_gguf(path, out, max_tensors: int, *, empty_first: bool = False) -> list:
    """The GGUF at `path` written again as llama.cpp's gguf-split writes it, as
    `out`'s stem + `-0000k-of-0000n.gguf` beside `out`: at most `max_tensors` tensors a
    part, in the file's order (none in part 1 with `empty_first`, as
    `--no-tensor-first-split`); part 1 holds every key/value, each part the `split.*` keys
    (gguf's GGUFWriter splits). The parts' paths, in order."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=max_tensors,
                        small_first_shard=empty_first)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
