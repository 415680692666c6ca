"""Gemma 3 and EmbeddingGemma (`Gemma3TextModel`): the network (model.py) and its GGUF map
(gguf.py); no config fields of its own, tensor parallel, on torch and MLX."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from swaserve.models.family import FamilyBase, MLXLayer, Tensors
from swaserve.models.gemma3 import gguf


class Gemma3(FamilyBase):
    name = "gemma3"
    # EmbeddingGemma's checkpoint: Gemma 3's layers, no LM head of its own
    architectures = {"Gemma3ForCausalLM": "Gemma3ForCausalLM",
                     "Gemma3TextModel": "Gemma3TextModel",
                     "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
    gguf_architectures = gguf.ARCHITECTURES
    mlx_layer = MLXLayer.SANDWICH_GEGLU

    def model_class(self, architecture: str) -> type:
        from swaserve.models.gemma3.model import Gemma3ForCausalLM

        return Gemma3ForCausalLM

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        return gguf.config_from_gguf(meta, arch)

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        return gguf.tensors_from_gguf(arch, hf, tensors)


FAMILY = Gemma3()
