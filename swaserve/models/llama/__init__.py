"""Llama 3, Mistral, Qwen2 and Qwen3: one network (model.py), the Llama-style GGUF map
(gguf.py); no config fields of their own, tensor parallel, on torch and MLX."""

from __future__ import annotations

from swaserve.models.family import FamilyBase, MLXLayer
from swaserve.models.llama import gguf


class Llama(FamilyBase):
    name = "llama"
    architectures = {a: a for a in ("LlamaForCausalLM", "MistralForCausalLM",
                                    "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
    gguf_map = gguf
    mlx_layer = MLXLayer.PRE_NORM_SWIGLU


FAMILY = Llama()
