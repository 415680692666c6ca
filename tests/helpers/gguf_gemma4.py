"""What llama.cpp's converter (its Gemma4Model) writes for a Gemma 4 text model beyond the
generic part that gguf_writer.py writes: the per-kind head sizes and RoPE dimensions, the
sliding pattern as a list, per-layer KV heads and MLP widths where the kinds differ, the
KV sharing and per-layer input sizes, the experts' keys, the full layers' partial RoPE as
frequency factors, and the tensors whose names it spells with a suffix of its own."""

from __future__ import annotations

import numpy as np

# HF layer tensors with no `.weight` of their own -> the GGUF tensor name's tail
_BARE = {"layer_scalar": "layer_output_scale.weight", "router.scale": "ffn_gate_inp.scale",
         "router.per_expert_scale": "ffn_down_exps.scale",
         "experts.gate_up_proj": "ffn_gate_up_exps.weight",
         "experts.down_proj": "ffn_down_exps.weight"}


def gguf_name(name: str) -> str | None:
    """The GGUF name of one of Gemma 4's irregularly named HF tensors, or None."""
    parts = name.split(".")
    if len(parts) < 4 or parts[1] != "layers":
        return None
    tail = _BARE.get(".".join(parts[3:]))
    return None if tail is None else f"blk.{parts[2]}.{tail}"


def add_metadata(w, cfg) -> None:
    """Gemma4Model.set_gguf_parameters's keys over the generic ones (which it overwrites)."""
    hp = cfg.to_dict()
    n, types = cfg.num_hidden_layers, list(cfg.layer_types)
    sliding = [t == "sliding_attention" for t in types]
    shared = hp.get("num_kv_shared_layers") or 0
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_sliding_window(cfg.sliding_window)
    full_dim, kv_full = _full_layer(hp, "head_dim"), _full_layer(hp, "num_key_value_heads")
    swa_dim = hp["head_dim"]
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("enable_moe_block"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("use_double_wide_mlp"):
        ff = hp["intermediate_size"]
        w.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)])
    if kv_full is not None:
        w.add_head_count_kv([hp["num_key_value_heads"] if s else kv_full for s in sliding])
    swa_rope = cfg.rope_parameters.get("sliding_attention", {})
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(int(swa_dim * swa_rope.get("partial_rotary_factor", 1.0)))


def _full_layer(hp: dict, field: str) -> int | None:
    """A full layer's head size or KV heads as the converter finds it: the `global_*` field,
    else the first full layer's entry in `per_layer_config`."""
    value = hp.get({"head_dim": "global_head_dim",
                    "num_key_value_heads": "num_global_key_value_heads"}[field])
    if value is not None:
        return value
    for i, layer in sorted((int(k), v) for k, v in (hp.get("per_layer_config") or {}).items()):
        if hp["layer_types"][i] == "full_attention" and field in layer:
            return layer[field]
    return None


def rope_freqs(cfg) -> np.ndarray:
    """The full layers' `proportional` RoPE as factors per frequency: 1 on the rotated
    pairs, 1e30 (no rotation) on the rest."""
    dim = _full_layer(cfg.to_dict(), "head_dim")
    rotated = int(dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (dim // 2 - rotated), dtype=np.float32)
