"""GGUF metadata as an HF config dict, per GGUF architecture, so that ModelConfig.from_hf
reads both formats.

The keys are the ones llama.cpp's converter writes (`<arch>.block_count`,
`<arch>.rope.scaling.*`, `tokenizer.ggml.*_token_id`, ...). What a GGUF leaves out is each
family's fixed design: Gemma 3's five sliding layers per full one and its local RoPE base,
gpt-oss's alternation of sliding and full layers and its YaRN without truncation. A Llama 3
GGUF carries its RoPE scaling as per-frequency factors (the `rope_freqs` tensor), not as
metadata; they become a `freq_factors` RoPE (models/layers.py rope_inv_freq).
"""

from __future__ import annotations

from typing import Any

from swaserve.checkpoint.gguf_meta import GGML_READABLE, GGML_TYPE_NAMES, ggml_type_name

# GGUF architecture -> the HF architecture swaserve runs it as (Mistral GGUFs are `llama`)
GGUF_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
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
