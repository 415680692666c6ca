"""Model registry: HF architecture name -> model class."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "Gemma3ForCausalLM": ("swaserve.models.gemma3.model", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("swaserve.models.gemma4.model", "Gemma4ForCausalLM"),
    # EmbeddingGemma's checkpoint: Gemma 3's layers, no LM head of its own
    "Gemma3TextModel": ("swaserve.models.gemma3.model", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("swaserve.models.llama.model", "LlamaForCausalLM"),
    "MistralForCausalLM": ("swaserve.models.llama.model", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("swaserve.models.llama.model", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("swaserve.models.llama.model", "LlamaForCausalLM"),
    "DeepseekV4ForCausalLM": ("swaserve.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "GptOssForCausalLM": ("swaserve.models.gpt_oss.model", "GptOssForCausalLM"),
    "Qwen3_5ForCausalLM": ("swaserve.models.qwen3_5.model", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("swaserve.models.qwen3_5.model", "Qwen3_5ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str):
    if architecture not in _REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
