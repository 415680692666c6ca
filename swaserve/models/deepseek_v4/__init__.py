"""DeepSeek-V4: the network (model.py), its MoE (moe.py) and compressed attention
(compressor.py), its config (config.py: defaults, legacy names, each layer's compression,
refusals, `DeepseekV4Config`); no GGUF map, one rank only, torch only."""

from __future__ import annotations

from typing import Any

from swaserve.models.deepseek_v4.config import DeepseekV4Config, compress_layout, with_defaults
from swaserve.models.family import FamilyBase, FamilyConfig


class DeepseekV4(FamilyBase):
    name = "deepseek_v4"
    one_rank_only = "compressed attention, hyper-connections"
    architectures = {"DeepseekV4ForCausalLM": "DeepseekV4ForCausalLM"}

    def claims(self, hf: dict[str, Any]) -> bool:
        return super().claims(hf) or hf.get("model_type") == "deepseek_v4"

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        """Every layer keeps a sliding K=V window (the generic layer types); C4 / C128 layers
        keep compressed state too (`layer_compress`, `attention_types`)."""
        hf = with_defaults(hf)
        fields = dict(layer_compress=compress_layout(hf))
        spec = DeepseekV4Config.from_hf(hf)
        hf = {**hf, "attention_types": hf["layer_types"],
              "layer_types": ["sliding_attention"] * int(hf["num_hidden_layers"]),
              "intermediate_size": hf["moe_intermediate_size"]}
        return FamilyConfig(hf, fields, spec)


FAMILY = DeepseekV4()
