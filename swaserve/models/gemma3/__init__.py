"""Gemma 3 and EmbeddingGemma (`Gemma3TextModel`): the network (model.py) and its GGUF map
(gguf.py); no config fields of its own, tensor parallel, on torch and MLX."""

from __future__ import annotations

from swaserve.models.family import FamilyBase, MLXLayer
from swaserve.models.gemma3 import gguf


class Gemma3(FamilyBase):
    name = "gemma3"
    # EmbeddingGemma's checkpoint: Gemma 3's layers, no LM head of its own
    architectures = {"Gemma3ForCausalLM": "Gemma3ForCausalLM",
                     "Gemma3TextModel": "Gemma3TextModel",
                     "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
    gguf_map = gguf
    mlx_layer = MLXLayer.SANDWICH_GEGLU


FAMILY = Gemma3()
