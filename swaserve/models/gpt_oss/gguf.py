"""gpt-oss GGUFs: even layers slide and odd ones are full (llama.cpp's pattern of 2), routed
experts, YaRN without truncation (config.json's `truncate: false`, which the GGUF does not
carry); the experts are split into gate / up / down stacks ([experts, out, in], or gate and
up fused as one stack), where the HF checkpoint keeps gate and up interleaved in one
[experts, in, 2 * out] tensor."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from swaserve.models.gguf import LAYER, base_config, hf_name, keys, renamed

ARCHITECTURES = {"gpt-oss": "GptOssForCausalLM"}
LAYER_NAMES = {**LAYER, "post_attention_norm": "post_attention_layernorm",
               "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"}


def config_from_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    cfg = base_config(meta, arch, ARCHITECTURES[arch])
    g = keys(meta, arch)
    n = cfg["num_hidden_layers"]
    cfg.update(
        sliding_window=int(g("attention.sliding_window")),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        num_local_experts=int(g("expert_count")),
        num_experts_per_tok=int(g("expert_used_count")),
        attention_bias=True)
    if cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
        cfg["rope_scaling"]["truncate"] = False
    return cfg


def tensors_from_gguf(arch: str, hf_config: dict[str, Any],
                      tensors: Iterable[tuple[str, np.ndarray]]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    return renamed(tensors, lambda name: hf_name(name, LAYER_NAMES), experts=_experts)


def _experts(layer: str, part: str, kind: str, group: dict[str, np.ndarray]
             ) -> tuple[str, np.ndarray] | None:
    """The HF expert tensor once the GGUF tensors it is made of are all there: down
    [E, out, in] -> [E, in, out]; gate and up (two stacks, or one with gate first) ->
    [E, in, 2 * out] with gate in the even columns, up in the odd (biases alike)."""
    base = f"model.layers.{layer}.mlp.experts."
    suffix = "_bias" if kind == "bias" else ""
    if "down" in group:
        d = group["down"]
        return base + "down_proj" + suffix, d if kind == "bias" else d.swapaxes(1, 2)
    if "gate_up" in group:
        gate, up = np.split(group["gate_up"], 2, axis=1)
    elif "gate" in group and "up" in group:
        gate, up = group["gate"], group["up"]
    else:
        return None
    fused = np.stack([gate, up], axis=2)  # [E, out, 2, (in)]: gate, up alternate
    if kind == "bias":
        return base + "gate_up_proj" + suffix, fused.reshape(gate.shape[0], -1)
    return base + "gate_up_proj", fused.reshape(gate.shape[0], -1, gate.shape[2]).swapaxes(1, 2)
