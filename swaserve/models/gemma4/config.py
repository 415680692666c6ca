"""Gemma 4 text configs (`gemma4_text`, or a `gemma4` checkpoint's text_config): transformers'
defaults filled in where config.json leaves a field out, the per-layer attention shapes
(full layers with `global_head_dim` and, with `attention_k_eq_v`, their own KV head count),
which layers reuse another layer's KV (`num_kv_shared_layers`), and the options swaserve does
not implement refused by the field that turns them on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PATTERN = 6  # transformers' default layer pattern: five sliding layers, then a full one

# fields whose missing value means transformers' default, not the generic parser's
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6, "sliding_window": 512, "max_position_embeddings": 131_072, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
    "enable_moe_block": False, "attention_bias": False, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}},
}


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' Gemma4TextConfig defaults where it has no value, and
    unsupported options refused."""
    out = dict(cfg)
    for key, value in DEFAULTS.items():  # a field written as null keeps its null (PLE off)
        if key not in out or (key == "rope_parameters" and out[key] is None):
            out[key] = value
    n = int(out["num_hidden_layers"])
    if out.get("layer_types") is None:
        out["layer_types"] = ["sliding_attention" if (i + 1) % PATTERN else "full_attention"
                              for i in range(n)]
    out["layer_types"] = list(out["layer_types"])
    out["layer_types"][-1] = "full_attention"  # transformers forces the last layer full
    _refuse(out)
    return out


def _refuse(cfg: dict[str, Any]) -> None:
    def no(field: str, why: str) -> None:
        raise ValueError(f"{field}: {why} (Gemma 4); swaserve refuses the checkpoint rather "
                         "than run it wrong")

    if cfg.get("enable_moe_block"):
        for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not cfg.get(field):
                no(field, "the MoE block (enable_moe_block) needs it")
    if cfg.get("use_bidirectional_attention") is not None:
        no("use_bidirectional_attention", "only causal attention is implemented")
    if cfg["hidden_activation"] != "gelu_pytorch_tanh":
        no("hidden_activation", f"{cfg['hidden_activation']!r} is not implemented")
    if cfg.get("attention_bias"):
        no("attention_bias", "attention biases are not implemented")
    rope = cfg["rope_parameters"]
    kinds = {"sliding_attention": ("default",), "full_attention": ("default", "proportional")}
    for kind, allowed in kinds.items():
        rope_type = (rope.get(kind) or {}).get("rope_type", "default")
        if rope_type not in allowed:
            no("rope_parameters", f"{kind} RoPE {rope_type!r} is not implemented")


def layer_shapes(cfg: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head size, KV heads) of each layer: sliding layers take `head_dim` and
    `num_key_value_heads`; full layers `global_head_dim` (or a written `per_layer_config`)
    and, with `attention_k_eq_v`, `num_global_key_value_heads`."""
    n = int(cfg["num_hidden_layers"])
    head_dim = int(cfg["head_dim"])
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    full = [t == "full_attention" for t in cfg["layer_types"]]
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        override: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        per_layer = {i: override for i in range(n) if full[i]}
    per_layer = {int(k): v for k, v in per_layer.items()}
    dims, heads = [], []
    for i in range(n):
        o = per_layer.get(i, {})
        unknown = set(o) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ValueError(f"per_layer_config: layer {i} overrides {sorted(unknown)}, which "
                             "swaserve does not implement (Gemma 4)")
        dims.append(int(o.get("head_dim", head_dim)))
        heads.append(int(o.get("num_key_value_heads", kv)))
    for kind in (True, False):  # one shape per layer kind: RoPE tables are per kind
        shapes = {(dims[i], heads[i]) for i in range(n) if full[i] is kind}
        if len(shapes) > 1:
            raise ValueError("per_layer_config: layers of one kind with different shapes are "
                             "not implemented (Gemma 4)")
    return tuple(dims), tuple(heads)


def kv_sources(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Per layer, the layer whose KV it reuses (None: it stores its own): the last
    `num_kv_shared_layers` layers read the last earlier layer of their own kind, as
    transformers' `kv_sharing_modes` has it."""
    n, shared = int(cfg["num_hidden_layers"]), int(cfg.get("num_kv_shared_layers") or 0)
    if shared == 0:
        return (None,) * n
    first = n - shared
    if first <= 0:
        raise ValueError(f"num_kv_shared_layers: {shared} leaves no layer to store KV (Gemma 4)")
    types = cfg["layer_types"]
    out: list[int | None] = [None] * first
    for i in range(first, n):
        src = [j for j in range(first) if types[j] == types[i]]
        if not src:
            raise ValueError(f"num_kv_shared_layers: layer {i} ({types[i]}) has no earlier "
                             "layer of its kind to reuse (Gemma 4)")
        out.append(src[-1])
    return tuple(out)


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4's own fields, read from a config `with_defaults` filled in."""

    attention_k_eq_v: bool = False  # full layers' V is their K (one projection)
    use_double_wide_mlp: bool = False  # the KV-sharing layers' MLP is twice as wide
    hidden_size_per_layer_input: int = 0  # per-layer inputs' width; 0: none
    vocab_size_per_layer_input: int = 0  # their embedding's rows; 0: the vocabulary's
    enable_moe_block: bool = False  # routed experts beside the MLP
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma4Config:
        # each field the config's value, 0 / False where it is null (per-layer inputs off)
        return cls(**{f: type(getattr(cls, f))(cfg.get(f) or 0)
                      for f in cls.__dataclass_fields__})
