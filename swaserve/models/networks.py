"""Architecture name -> the torch network that runs it, imported on first use (reading a
config imports no torch). The families' networks import ModelConfig, which finds the family
through models/registry.py, so this table lives apart from the registry: no family object
imports its network."""

from __future__ import annotations

import importlib

from swaserve.models.registry import FAMILIES

# family name -> (its network's module, the class)
_NETWORKS = {
    "gemma3": ("swaserve.models.gemma3.model", "Gemma3ForCausalLM"),
    "gemma4": ("swaserve.models.gemma4.model", "Gemma4ForCausalLM"),
    "llama": ("swaserve.models.llama.model", "LlamaForCausalLM"),
    "deepseek_v4": ("swaserve.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "gpt_oss": ("swaserve.models.gpt_oss.model", "GptOssForCausalLM"),
    "qwen3_5": ("swaserve.models.qwen3_5.model", "Qwen3_5ForCausalLM"),
}


def _families_by_architecture() -> dict[str, str]:
    return {arch: f.name for f in FAMILIES for arch in f.architectures.values()}


def supported_architectures() -> list[str]:
    return sorted(_families_by_architecture())


def model_class(architecture: str) -> type:
    """The torch network of an architecture a config runs as (`ModelConfig.architecture`)."""
    family = _families_by_architecture().get(architecture)
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _NETWORKS[family]
    return getattr(importlib.import_module(module), name)
