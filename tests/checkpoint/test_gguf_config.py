"""GGUF metadata keys that the tiny GGUFs of test_gguf_families.py do not carry, read into
the config: linear and YaRN scaling, Gemma 2's soft caps, every end-of-generation id,
unequal key and value lengths."""

from __future__ import annotations

import pytest

from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf
from swaserve.models.config import ModelConfig


def _meta(arch: str, **keys) -> dict:
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens#len": 2048,
            "GGUF.tensor_types": {"token_embd.weight": 8}}
    for key, value in {"block_count": 4, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.head_count_kv": 2,
                       **keys}.items():
        meta[f"{arch}.{key}"] = value
    return meta


def test_linear_rope_scaling_soft_caps_and_end_of_generation_ids():
    meta = _meta("qwen2", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0,
                             "final_logit_softcapping": 30.0, "rope.freq_base": 1e6})
    meta.update({"tokenizer.ggml.eos_token_id": 5, "tokenizer.ggml.eot_token_id": 7,
                 "tokenizer.ggml.eom_token_id": 5, "tokenizer.ggml.bos_token_id": 1})
    cfg = ModelConfig.from_hf(gguf_metadata_to_hf(meta))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.rope_theta == 1e6 and cfg.final_logit_softcapping == 30.0
    assert cfg.eos_token_ids == (5, 7) and cfg.bos_token_id == 1
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings and cfg.vocab_size == 2048
    assert cfg.layer_types == ("full",) * 4 and cfg.architecture == "Qwen2ForCausalLM"


def test_gpt_oss_yarn_keeps_the_files_betas_and_does_not_truncate():
    meta = _meta("gpt-oss", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                               "rope.scaling.original_context_length": 4096,
                               "rope.scaling.yarn_beta_fast": 16.0,
                               "attention.sliding_window": 128, "expert_count": 8,
                               "expert_used_count": 2, "expert_feed_forward_length": 96})
    cfg = ModelConfig.from_hf(gguf_metadata_to_hf(meta))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 16.0,
                                "original_max_position_embeddings": 4096, "truncate": False}
    assert cfg.layer_types == ("sliding", "full") * 2 and cfg.sliding_window == 128
    assert cfg.intermediate_size == 96 and cfg.raw["num_local_experts"] == 8


def test_unequal_key_and_value_lengths_are_refused():
    meta = _meta("qwen3", **{"attention.key_length": 16, "attention.value_length": 32})
    with pytest.raises(ValueError, match="key length 16 != value length 32"):
        gguf_metadata_to_hf(meta)
