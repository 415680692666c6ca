"""Llama, Mistral (GGUF `llama`), Qwen2 and Qwen3 GGUFs: the shared metadata and names, plus
what a Llama GGUF carries its own way: RoPE scaling as per-frequency factors (the
`rope_freqs` tensor, a `freq_factors` RoPE: models/layers.py rope_inv_freq), Mistral's one
window on every layer, q/k biases told by their tensors, and q/k rows permuted into
llama.cpp's interleaved RoPE order."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from swaserve.models.gguf import LAYER, base_config, hf_name, keys, renamed

# GGUF architecture -> the HF architecture swaserve runs it as (Mistral GGUFs are `llama`)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
LAYER_NAMES = {**LAYER, "ffn_norm": "post_attention_layernorm"}


def config_from_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The HF config of a `llama`, `qwen2` or `qwen3` GGUF."""
    cfg = base_config(meta, arch, ARCHITECTURES[arch])
    if arch == "llama":
        g = keys(meta, arch)
        types = meta.get("GGUF.tensor_types", {})
        if meta.get("GGUF.rope_freqs") is not None:
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": meta["GGUF.rope_freqs"]}
        if g("attention.sliding_window"):  # Mistral: one window on every layer
            cfg["sliding_window"] = int(g("attention.sliding_window"))
        cfg["attention_bias"] = "blk.0.attn_q.bias" in types
    return cfg


def permuted_heads(arch: str, name: str, hf_config: dict[str, Any]) -> int | None:
    """How many heads llama.cpp permuted a tensor's rows over (Llama's q and k), or None."""
    if arch != "llama":
        return None
    if re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", name):
        return int(hf_config["num_attention_heads"])
    if re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", name):
        return int(hf_config["num_key_value_heads"])
    return None


def tensors_from_gguf(arch: str, hf_config: dict[str, Any],
                      tensors: Iterable[tuple[str, np.ndarray]]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors, q/k rows back in HF's order."""
    return renamed(tensors, lambda name: hf_name(name, LAYER_NAMES),
                   heads_of=lambda name: permuted_heads(arch, name, hf_config))
