"""Gemma 4 GGUFs: per-layer lists where the layer kinds differ (KV heads, MLP widths; the full
layers' shapes become `per_layer_config`), sliding layers' head size and RoPE under `*_swa`
keys, the full layers' partial RoPE as frequency factors (1e30 on the unrotated pairs:
transformers' `proportional` RoPE), and K=V full layers told by their missing V projection
(the converter writes no key for it). Norms store w (not Gemma 3's 1 + w); the scalars,
router scales and expert stacks are stored as HF stores them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from swaserve.models.gguf import (
    LAYER,
    Keys,
    hf_name,
    keys,
    per_layer,
    renamed,
    special_tokens,
    vocab_size,
)

ARCHITECTURES = {"gemma4": "Gemma4ForCausalLM"}
LAYER_NAMES = {**LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
               "post_ffw_norm_1": "post_feedforward_layernorm_1",
               "post_ffw_norm_2": "post_feedforward_layernorm_2",
               "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
               "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj"}
# layer tensors whose HF names carry no `.weight`: the scalar, router scales and expert
# stacks ([experts, out, in])
BARE = {"layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj"}


def tensors_from_gguf(arch: str, hf_config: dict[str, Any],
                      tensors: Iterable[tuple[str, np.ndarray]]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    return renamed(tensors, lambda name: hf_name(name, LAYER_NAMES, BARE))


def config_from_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The HF config of a Gemma 4 GGUF (the module's docstring says how); it then goes
    through config.py's defaults and refusals."""
    g = keys(meta, arch)
    types = meta.get("GGUF.tensor_types", {})
    n = int(g("block_count"))
    swa = g("attention.sliding_window_pattern")
    sliding = [bool(s) for s in swa] if isinstance(swa, list) else [False] * n
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    shared = int(g("attention.shared_kv_layers", 0))
    head_full = int(g("attention.key_length"))
    head_swa = int(g("attention.key_length_swa", head_full))
    for kind, k, v in (("full", head_full, g("attention.value_length", head_full)),
                       ("sliding", head_swa, g("attention.value_length_swa", head_swa))):
        if int(v) != k:
            raise ValueError(f"GGUF gemma4: {kind} layers' key length {k} != value length {v}")
    if int(g("rope.dimension_count_swa", head_swa)) != head_swa:
        raise ValueError("GGUF gemma4: partial RoPE on sliding layers is not implemented")
    kv = per_layer(g("attention.head_count_kv", g("attention.head_count")), n)
    ff = per_layer(g("feed_forward_length"), n)
    full = [i for i in range(n) if not sliding[i]]
    kv_swa = next((kv[i] for i in range(n) if sliding[i]), kv[0])
    k_eq_v = any(f"blk.{i}.attn_v.weight" not in types for i in full if i < n - shared)
    wide = ff[-1] == 2 * ff[0] and ff[-1] != ff[0]
    if any(w != (2 * ff[0] if wide and i >= n - shared else ff[0]) for i, w in enumerate(ff)):
        raise ValueError(f"GGUF gemma4: MLP widths {ff} are not one width (doubled on the KV "
                         "sharing layers) as swaserve implements")
    rope_full = _full_rope(meta, g, head_full)
    hidden = int(g("embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES["gemma4"]], "model_type": "gemma4_text",
        "hidden_size": hidden, "num_hidden_layers": n,
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": kv_swa, "head_dim": head_swa,
        "per_layer_config": {i: {"head_dim": head_full, "num_key_value_heads": kv[i]}
                             for i in full},
        "attention_k_eq_v": k_eq_v, "num_kv_shared_layers": shared,
        "intermediate_size": ff[0], "use_double_wide_mlp": wide,
        "hidden_size_per_layer_input": int(g("embedding_length_per_layer_input", 0)),
        "layer_types": layer_types, "sliding_window": int(g("attention.sliding_window")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g("context_length", 131_072)),
        "final_logit_softcapping": g("final_logit_softcapping"),
        "rope_parameters": {"full_attention": rope_full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(g("rope.freq_base_swa", 10_000.0))}},
        "tie_word_embeddings": "output.weight" not in types,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        **special_tokens(meta)}
    vocab = vocab_size(meta)
    if vocab:
        cfg["vocab_size"] = cfg["vocab_size_per_layer_input"] = int(vocab)
    if meta.get("GGUF.per_layer_vocab"):  # the converter trims token_embd's rows, not these
        cfg["vocab_size_per_layer_input"] = int(meta["GGUF.per_layer_vocab"])
    if g("expert_count"):
        cfg.update(enable_moe_block=True, num_experts=int(g("expert_count")),
                   top_k_experts=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")))
    return cfg


def _full_rope(meta: dict[str, Any], g: Keys, head_full: int) -> dict[str, Any]:
    """The full layers' RoPE section: a partial rotation told by `rope_freqs` (1 on the
    rotated pairs, 1e30 on the others) becomes transformers' `proportional` RoPE."""
    rope_full: dict[str, Any] = {"rope_type": "default",
                                 "rope_theta": float(g("rope.freq_base", 1_000_000.0))}
    factors = meta.get("GGUF.rope_freqs")
    if factors is None and int(g("rope.dimension_count", head_full)) != head_full:
        raise ValueError("GGUF gemma4: partial RoPE without rope_freqs is not implemented")
    if factors is not None:
        rotated = sum(1 for f in factors if f < 1e29)
        if any(f != 1.0 for f in factors[:rotated]) or len(factors) * 2 != head_full:
            raise ValueError("GGUF gemma4: rope_freqs other than a partial rotation")
        rope_full.update(rope_type="proportional", partial_rotary_factor=2 * rotated / head_full)
    return rope_full
