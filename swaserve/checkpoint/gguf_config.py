"""GGUF metadata as an HF config dict, per GGUF architecture, so that ModelConfig.from_hf
reads both formats.

The keys are the ones llama.cpp's converter writes (`<arch>.block_count`,
`<arch>.rope.scaling.*`, `tokenizer.ggml.*_token_id`, ...). What a GGUF leaves out is each
family's fixed design: Gemma 3's five sliding layers per full one and its local RoPE base,
Gemma 4's K=V full layers (told by their missing V projection), gpt-oss's alternation of sliding and full layers and its YaRN without truncation. A Llama 3
GGUF carries its RoPE scaling as per-frequency factors (the `rope_freqs` tensor), not as
metadata; they become a `freq_factors` RoPE (models/layers.py rope_inv_freq).
"""

from __future__ import annotations

from typing import Any

from swaserve.checkpoint.gguf_meta import GGML_READABLE, GGML_TYPE_NAMES, ggml_type_name

# GGUF architecture -> the HF architecture swaserve runs it as (Mistral GGUFs are `llama`)
GGUF_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gpt-oss": "GptOssForCausalLM"}
# llama.cpp's `rope.scaling.type` values -> HF rope types
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def gguf_metadata_to_hf(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF-style config dict from GGUF key/values (gguf_meta.read_gguf_metadata's, with
    its tensor types); a ValueError names what swaserve cannot run (the architecture, a
    tensor's type)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
    types = meta.get("GGUF.tensor_types", {})
    check_tensor_types(types)

    def g(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        return default if value is None else value

    if arch == "gemma4":
        return _gemma4(meta, g, types)
    n = int(g("block_count"))
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}: key length {head_dim} != value length "
                         f"{g('attention.value_length')} (swaserve needs them equal)")
    vocab = meta.get("tokenizer.ggml.tokens#len") or len(meta.get("tokenizer.ggml.tokens", ()))
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(g("expert_feed_forward_length") or g("feed_forward_length")),
        "vocab_size": int(g("vocab_size") or vocab),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(g("context_length", 8192)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in types,
        **_special_tokens(meta),
    }
    scaling = _rope_scaling(g)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's keys
        if g(cap) is not None:
            cfg[cap] = float(g(cap))
    if arch == "gemma3":
        return _gemma3(cfg, g)
    if arch == "gpt-oss":
        return _gpt_oss(cfg, g)
    if arch == "llama":
        if meta.get("GGUF.rope_freqs") is not None:
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": meta["GGUF.rope_freqs"]}
        if g("attention.sliding_window"):  # Mistral: one window on every layer
            cfg["sliding_window"] = int(g("attention.sliding_window"))
        cfg["attention_bias"] = "blk.0.attn_q.bias" in types
    return cfg


def check_tensor_types(types: dict[str, int]) -> None:
    """A ValueError naming the first tensor of a type swaserve cannot read."""
    for name, ggml_type in types.items():
        if ggml_type not in GGML_READABLE:
            readable = ", ".join(GGML_TYPE_NAMES[t] for t in sorted(GGML_READABLE))
            raise ValueError(f"GGUF tensor {name!r} has type {ggml_type_name(ggml_type)}, "
                             f"which swaserve cannot read (readable: {readable})")


def _special_tokens(meta: dict[str, Any]) -> dict[str, Any]:
    """bos, pad, and as eos every id llama.cpp ends generation at (eos, end of turn, end of
    message), eos first."""
    eos = []
    for key in ("eos", "eot", "eom"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and int(tid) not in eos:
            eos.append(int(tid))
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}


def _rope_scaling(g) -> dict[str, Any] | None:
    """`rope.scaling.*` as an HF rope_scaling dict; None when unscaled."""
    kind = g("rope.scaling.type")
    if kind is None or _ROPE_TYPES.get(kind) == "default":
        return None
    if kind not in _ROPE_TYPES:
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": _ROPE_TYPES[kind],
                               "factor": float(g("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if g(f"rope.scaling.{key}") is not None:
                scaling[hf] = float(g(f"rope.scaling.{key}"))
    return scaling


def _gemma3(cfg: dict[str, Any], g) -> dict[str, Any]:
    """Gemma 3: five sliding layers per full one (the GGUF keeps only W), local RoPE base
    10,000 unless the file says (unscaled), query scale 1/sqrt(head_dim), GELU (tanh)."""
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


def _gpt_oss(cfg: dict[str, Any], g) -> dict[str, Any]:
    """gpt-oss: even layers slide, odd ones are full (llama.cpp's pattern of 2); routed
    experts; YaRN without truncation (its config.json's `truncate: false`, which the GGUF
    does not carry)."""
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


def _gemma4(meta: dict[str, Any], g, types: dict[str, int]) -> dict[str, Any]:
    """Gemma 4: per-layer lists where the layer kinds differ (KV heads, MLP widths; the full
    layers' shapes become `per_layer_config`), sliding layers' head size and RoPE under
    `*_swa` keys, the full layers' partial RoPE as frequency factors (1e30 on the unrotated
    pairs: transformers' `proportional` RoPE), and K=V full layers told by their missing V
    projection (the converter writes no key for it). The result goes through
    gemma4_config's defaults and refusals."""
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
    kv = _per_layer(g("attention.head_count_kv", g("attention.head_count")), n)
    ff = _per_layer(g("feed_forward_length"), n)
    full = [i for i in range(n) if not sliding[i]]
    kv_swa = next((kv[i] for i in range(n) if sliding[i]), kv[0])
    k_eq_v = any(f"blk.{i}.attn_v.weight" not in types for i in full if i < n - shared)
    wide = ff[-1] == 2 * ff[0] and ff[-1] != ff[0]
    if any(w != (2 * ff[0] if wide and i >= n - shared else ff[0]) for i, w in enumerate(ff)):
        raise ValueError(f"GGUF gemma4: MLP widths {ff} are not one width (doubled on the KV "
                         "sharing layers) as swaserve implements")
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
    hidden = int(g("embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES["gemma4"]], "model_type": "gemma4_text",
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
        **_special_tokens(meta)}
    vocab = meta.get("tokenizer.ggml.tokens#len") or len(meta.get("tokenizer.ggml.tokens", ()))
    if vocab:
        cfg["vocab_size"] = cfg["vocab_size_per_layer_input"] = int(vocab)
    if meta.get("GGUF.per_layer_vocab"):  # the converter trims token_embd's rows, not these
        cfg["vocab_size_per_layer_input"] = int(meta["GGUF.per_layer_vocab"])
    if g("expert_count"):
        cfg.update(enable_moe_block=True, num_experts=int(g("expert_count")),
                   top_k_experts=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")))
    return cfg


def _per_layer(value: Any, n: int) -> list[int]:
    """A per-layer key (one value for all layers, or a list) as a list of n ints."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
