"""Qwen3.5 text configs (`qwen3_5_text` / `qwen3_5_moe_text`, or the `text_config` of a
`qwen3_5` / `qwen3_5_moe` checkpoint): transformers' defaults filled in where config.json
leaves a field out, the layer pattern (Gated DeltaNet "linear_attention" layers, a gated
full-attention layer every `full_attention_interval`), the recurrent state's shapes, and the
options swaserve does not implement refused by the field that turns them on.

RoPE: the text model's multimodal RoPE (`mrope_section`, `mrope_interleaved`) rotates every
section by the same text position, so for text it is the plain (partial, by
`partial_rotary_factor`) rotation whatever the sections; other RoPE types are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DENSE = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LAYER_TYPES = ("linear_attention", "full_attention")

# transformers' Qwen3_5TextConfig defaults, where config.json leaves a field out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "hidden_act": "silu", "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}
MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
}
ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}


def is_moe(cfg: dict[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return (bool(archs) and archs[0] in MOE) or str(
        cfg.get("model_type", "")).startswith("qwen3_5_moe")


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' defaults where it has no value, its layer pattern written
    out, and unsupported options refused."""
    out = dict(cfg)
    defaults = {**DEFAULTS, **MOE_DEFAULTS} if is_moe(cfg) else DEFAULTS
    for key, value in defaults.items():
        if out.get(key) is None:
            out[key] = value
    out["intermediate_size"] = out.get("intermediate_size") or 0
    rope = dict(out.get("rope_parameters") or out.get("rope_scaling") or {})
    for key, value in ROPE_DEFAULT.items():
        rope.setdefault(key, value)
    if "rope_theta" in cfg and "rope_theta" not in (out.get("rope_parameters") or {}):
        rope["rope_theta"] = cfg["rope_theta"]
    if "partial_rotary_factor" in cfg:
        rope["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    out["rope_parameters"] = rope
    n = int(out["num_hidden_layers"])
    if out.get("layer_types") is None:
        interval = int(out.get("full_attention_interval") or 4)
        out["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                              for i in range(n)]
    out["layer_types"] = list(out["layer_types"])
    out["sliding_window"] = None
    _refuse(out)
    return out


def _refuse(cfg: dict[str, Any]) -> None:
    def no(field: str, why: str) -> None:
        raise ValueError(f"{field}: {why} (Qwen3.5); swaserve refuses the checkpoint rather "
                         "than run it wrong")

    n = int(cfg["num_hidden_layers"])
    types = cfg["layer_types"]
    if len(types) != n:
        no("layer_types", f"{len(types)} entries for {n} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        no("layer_types", f"layer types {unknown} are not implemented (only "
                          "linear_attention and full_attention)")
    if cfg["hidden_act"] != "silu":
        no("hidden_act", f"{cfg['hidden_act']!r} is not implemented")
    if cfg.get("attention_bias"):
        no("attention_bias", "attention biases are not implemented")
    if cfg.get("attn_output_gate") is False:
        no("attn_output_gate", "only gated full attention is implemented")
    rope = cfg["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        no("rope_parameters", f"RoPE {rope['rope_type']!r} is not implemented")
    factor = float(rope.get("partial_rotary_factor", 1.0))
    rot = int(int(cfg["head_dim"]) * factor)
    if not 0 < rot <= int(cfg["head_dim"]) or rot % 2:
        no("partial_rotary_factor", f"{factor} of head_dim {cfg['head_dim']} is no even "
                                    "number of rotated dims")
    if int(cfg["linear_conv_kernel_dim"]) < 2:
        no("linear_conv_kernel_dim", "a convolution of fewer than 2 taps is not implemented")
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if hv % hk:
        no("linear_num_value_heads", f"{hv} value heads do not group over {hk} key heads")
    if is_moe(cfg):
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
            if not cfg.get(field):
                no(field, "the MoE block needs it")
    elif cfg.get("num_experts"):
        no("num_experts", "experts in a dense Qwen3.5 config are not implemented")


def rotary_dim(cfg: dict[str, Any]) -> int:
    """How many of a full-attention head's dims RoPE rotates (the first ones)."""
    factor = float(cfg["rope_parameters"].get("partial_rotary_factor", 1.0))
    return int(int(cfg["head_dim"]) * factor)


@dataclass(frozen=True)
class Qwen3_5Config:
    """Qwen3.5's own fields, read from a config `with_defaults` filled in."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rotary_dim: int  # a full-attention head's rotated dims (the first ones)
    moe: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3_5Config:
        moe = is_moe(cfg)
        linear = {f: int(cfg[f]) for f in ("linear_num_key_heads", "linear_num_value_heads",
                                           "linear_key_head_dim", "linear_value_head_dim",
                                           "linear_conv_kernel_dim")}
        experts = {f: int(cfg[f]) for f in ("num_experts", "num_experts_per_tok",
                                            "moe_intermediate_size",
                                            "shared_expert_intermediate_size")} if moe else {}
        return cls(**linear, rotary_dim=rotary_dim(cfg), moe=moe, **experts)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """A Gated DeltaNet layer's per-request state: the conv window (channels = q, k and
        v widths; kernel - 1 taps) and the recurrent matrices (value heads x d_k x d_v)."""
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        channels = 2 * hk * dk + hv * dv
        return (channels, self.linear_conv_kernel_dim - 1), (hv, dk, dv)
