"""gpt-oss: the network (model.py: sinks, YaRN, routed experts, MXFP4 unpacking), its config
fields (config.py) and GGUF map (gguf.py); tensor parallel within the experts, on torch and
MLX."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from swaserve.models.family import FamilyBase, FamilyConfig, MLXLayer, Tensors
from swaserve.models.gpt_oss import gguf
from swaserve.models.gpt_oss.config import GptOssConfig


class GptOss(FamilyBase):
    name = "gpt_oss"
    architectures = {"GptOssForCausalLM": "GptOssForCausalLM"}
    gguf_architectures = gguf.ARCHITECTURES
    mlx_layer = MLXLayer.SINKS_MOE

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        return FamilyConfig(hf, spec=GptOssConfig.from_hf(hf))

    def model_class(self, architecture: str) -> type:
        from swaserve.models.gpt_oss.model import GptOssForCausalLM

        return GptOssForCausalLM

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        return gguf.config_from_gguf(meta, arch)

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        return gguf.tensors_from_gguf(arch, hf, tensors)


FAMILY = GptOss()
