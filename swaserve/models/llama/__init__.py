"""Llama 3, Mistral, Qwen2 and Qwen3: one network (model.py), the Llama-style GGUF map
(gguf.py); no config fields of their own, tensor parallel, on torch and MLX."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from swaserve.models.family import FamilyBase, MLXLayer, Tensors
from swaserve.models.llama import gguf


class Llama(FamilyBase):
    name = "llama"
    architectures = {a: a for a in ("LlamaForCausalLM", "MistralForCausalLM",
                                    "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
    gguf_architectures = gguf.ARCHITECTURES
    mlx_layer = MLXLayer.PRE_NORM_SWIGLU

    def model_class(self, architecture: str) -> type:
        from swaserve.models.llama.model import LlamaForCausalLM

        return LlamaForCausalLM

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        return gguf.config_from_gguf(meta, arch)

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        return gguf.tensors_from_gguf(arch, hf, tensors)

    def permuted_heads(self, arch: str, name: str, hf: dict[str, Any]) -> int | None:
        return gguf.permuted_heads(arch, name, hf)


FAMILY = Llama()
