"""gpt-oss: the network (model.py: sinks, YaRN, routed experts, MXFP4 unpacking), its config
fields (config.py) and GGUF map (gguf.py); tensor parallel within the experts, on torch and
MLX."""

from __future__ import annotations

from typing import Any

from swaserve.models.family import Cut, FamilyBase, FamilyConfig, MLXLayer, Shapes
from swaserve.models.gpt_oss import gguf, shard
from swaserve.models.gpt_oss.config import GptOssConfig


class GptOss(FamilyBase):
    name = "gpt_oss"
    architectures = {"GptOssForCausalLM": "GptOssForCausalLM"}
    gguf_map = gguf
    mlx_layer = MLXLayer.SINKS_MOE

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        return FamilyConfig(hf, spec=GptOssConfig.from_hf(hf))

    def tensor_cut(self, name: str, shape: tuple[int, ...], cfg: Shapes, rank: int,
                   size: int) -> Cut | None:
        return shard.tensor_cut(name, shape, cfg, rank, size)


FAMILY = GptOss()
