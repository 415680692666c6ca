"""Gemma 3 GGUFs: what the file leaves out is the family's fixed design (five sliding layers
per full one, its local RoPE base, query scale 1/sqrt(head_dim), GELU (tanh)); llama.cpp
stores its norm multipliers as 1 + w."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from swaserve.models.gguf import LAYER, base_config, hf_name, keys, renamed

ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}
LAYER_NAMES = {**LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def config_from_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 3: the GGUF keeps only the window, not the layer pattern; local RoPE base
    10,000 unless the file says (unscaled)."""
    cfg = base_config(meta, arch, ARCHITECTURES[arch])
    g = keys(meta, arch)
    n = cfg["num_hidden_layers"]
    cfg.update(
        model_type="gemma3_text",
        rope_theta=float(g("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(g("rope.freq_base_swa", 10_000.0)),
        sliding_window=int(g("attention.sliding_window")),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(n)],
        max_position_embeddings=int(g("context_length", 32768)),
        query_pre_attn_scalar=cfg["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        intermediate_size=int(g("feed_forward_length")))
    return cfg


def _norm_as_hf(hf: str, arr: np.ndarray) -> np.ndarray:
    return arr - 1.0 if hf.endswith("norm.weight") else arr  # the GGUF stores 1 + w


def tensors_from_gguf(arch: str, hf_config: dict[str, Any],
                      tensors: Iterable[tuple[str, np.ndarray]]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    return renamed(tensors, lambda name: hf_name(name, LAYER_NAMES), adjust=_norm_as_hf)
