"""DeepSeek-V4 configs (`deepseek_v4`): transformers' defaults and legacy field names filled in,
each layer's compression (sliding only, C4 with the lightning indexer, C128), and the options
swaserve does not implement refused by the field that turns them on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # legacy `compress_ratios`

# transformers' DeepseekV4Config defaults (V4-Flash's shapes)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129_280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256,
    "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "max_position_embeddings": 1_048_576, "rope_theta": 10_000.0,
    "compress_rope_theta": 160_000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False,
}
DEFAULT_RATES = {CSA: 4, HCA: 128}
SCORING = ("sqrtsoftplus", "sigmoid")


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers' DeepseekV4Config reads it (defaults, legacy names, per-layer
    schedules, the main and compress RoPE), unsupported options refused."""
    out = dict(cfg)
    for key, value in DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    n = int(out["num_hidden_layers"])
    rates = dict(DEFAULT_RATES) | dict(out.get("compress_rates") or {})
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if out.get(legacy) is not None:
            rates[kind] = int(out[legacy])
    out["compress_rates"] = rates
    types = out.get("layer_types")
    if types is None and out.get("compress_ratios") is not None:
        types = [RATIO_TO_TYPE[int(r)] for r in out["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    out["layer_types"] = list(types)[:n]
    mlp = out.get("mlp_layer_types")
    if mlp is None:
        hashed = out.get("num_hash_layers")
        hashed = 3 if hashed is None else int(hashed)
        mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    out["mlp_layer_types"] = list(mlp)[:n]
    if out.get("partial_rotary_factor") is None:  # legacy configs give the rotary size
        rope_dim = out.get("qk_rope_head_dim")
        out["partial_rotary_factor"] = (int(rope_dim) / int(out["head_dim"])
                                        if rope_dim is not None else 64 / 512)
    out["rope_dim"] = int(int(out["head_dim"]) * float(out["partial_rotary_factor"]))
    out["rope_main"], out["rope_compress"] = _ropes(out)
    _refuse(out)
    return out


def _ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The main (sliding layers) and compress (C4 / C128 layers and their compressors) RoPE
    sections, as transformers builds them from `rope_parameters`."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    compress = {**scaling, "rope_theta": float(cfg["compress_rope_theta"])}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _refuse(cfg: dict[str, Any]) -> None:
    def no(field: str, why: str) -> None:
        raise ValueError(f"{field}: {why} (DeepSeek-V4); swaserve refuses the checkpoint "
                         "rather than run it wrong")

    n = int(cfg["num_hidden_layers"])
    for name, allowed in (("layer_types", (SLIDING, CSA, HCA)),
                          ("mlp_layer_types", ("hash_moe", "moe"))):
        values = cfg[name]
        if len(values) != n or any(v not in allowed for v in values):
            no(name, f"expected {n} entries of {allowed}, got {values}")
    if cfg.get("quantization_config"):
        no("quantization_config", "FP8 / FP4 checkpoints are not dequantized yet; convert "
           "the weights to bf16 first")
    if int(cfg["num_key_value_heads"]) != 1:
        no("num_key_value_heads", "the attention is one shared K=V head")
    if int(cfg["n_shared_experts"]) != 1:
        no("n_shared_experts", "one shared expert is implemented (transformers builds one)")
    if cfg["scoring_func"] not in SCORING:
        no("scoring_func", f"{cfg['scoring_func']!r} is not one of {SCORING}")
    if cfg["hidden_act"] != "silu":
        no("hidden_act", f"{cfg['hidden_act']!r} is not implemented")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            no(field, "biases are not implemented")
    if cfg.get("router_jitter_noise"):
        no("router_jitter_noise", "a training option")
    heads, groups = int(cfg["num_attention_heads"]), int(cfg["o_groups"])
    if heads % groups:
        no("o_groups", f"{heads} heads do not split into {groups} groups")
    if cfg["rope_dim"] % 2 or cfg["rope_dim"] > int(cfg["head_dim"]):
        no("partial_rotary_factor", f"a rotary part of {cfg['rope_dim']} channels")
    for name, section in (("main", cfg["rope_main"]), ("compress", cfg["rope_compress"])):
        if section.get("rope_type", "default") not in ("default", "yarn"):
            no("rope_parameters", f"{name} RoPE {section.get('rope_type')!r} is not implemented")
    for kind in (CSA, HCA):
        if kind in cfg["layer_types"] and int(cfg["compress_rates"][kind]) < 1:
            no("compress_rates", f"{kind} needs a rate of at least 1")


def compress_layout(cfg: dict[str, Any]) -> tuple[tuple[int, bool, int], ...]:
    """Per layer (rate, overlap, indexer head size); rate 0 for sliding-only layers."""
    out = []
    for kind in cfg["layer_types"]:
        if kind == SLIDING:
            out.append((0, False, 0))
        else:
            csa = kind == CSA
            out.append((int(cfg["compress_rates"][kind]), csa,
                        int(cfg["index_head_dim"]) if csa else 0))
    return tuple(out)


@dataclass(frozen=True)
class DeepseekV4Config:
    """DeepSeek-V4's own fields the network reads, from a config `with_defaults` filled in."""

    q_lora_rank: int
    o_lora_rank: int
    o_groups: int  # grouped low-rank output projection
    attention_types: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    compress_rates: dict[str, int]  # CSA / HCA -> tokens per compressed entry
    hc_mult: int  # residual streams mixed by hyper-connections
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_dim: int  # the rotated channels of a head
    rope_main: dict[str, Any]  # sliding layers' RoPE section
    rope_compress: dict[str, Any]  # compressed layers' (and their compressors') RoPE
    index_n_heads: int  # the lightning indexer's heads, head size and entries kept
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str  # "sqrtsoftplus" | "sigmoid": the router's expert scores
    routed_scaling_factor: float
    swiglu_limit: float  # the experts' gate and up pre-activations are clamped here
    moe_intermediate_size: int
    mlp_layer_types: tuple[str, ...]  # per layer: "moe" | "hash_moe"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV4Config:
        return cls(q_lora_rank=int(cfg["q_lora_rank"]), o_lora_rank=int(cfg["o_lora_rank"]),
                   o_groups=int(cfg["o_groups"]), attention_types=tuple(cfg["layer_types"]),
                   compress_rates={k: int(v) for k, v in cfg["compress_rates"].items()},
                   hc_mult=int(cfg["hc_mult"]), hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
                   hc_eps=float(cfg["hc_eps"]), rope_dim=int(cfg["rope_dim"]),
                   rope_main=dict(cfg["rope_main"]), rope_compress=dict(cfg["rope_compress"]),
                   index_n_heads=int(cfg["index_n_heads"]),
                   index_head_dim=int(cfg["index_head_dim"]), index_topk=int(cfg["index_topk"]),
                   n_routed_experts=int(cfg["n_routed_experts"]),
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   scoring_func=str(cfg["scoring_func"]),
                   routed_scaling_factor=float(cfg["routed_scaling_factor"]),
                   swiglu_limit=float(cfg["swiglu_limit"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   mlp_layer_types=tuple(cfg["mlp_layer_types"]))
