"""Gemma 4 (dense and MoE): the network (model.py), its config (config.py: defaults, per-layer
shapes, KV sources, refusals, `Gemma4Config`) and GGUF map (gguf.py); one rank only, torch
only."""

from __future__ import annotations

from typing import Any

from swaserve.models.family import FamilyBase, FamilyConfig
from swaserve.models.gemma4 import gguf
from swaserve.models.gemma4.config import Gemma4Config, kv_sources, layer_shapes, with_defaults


class Gemma4(FamilyBase):
    name = "gemma4"
    one_rank_only = "per-layer head shapes, KV shared across layers, per-layer inputs"
    architectures = {"Gemma4ForCausalLM": "Gemma4ForCausalLM",
                     "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}
    model_types = ("gemma4",)
    gguf_map = gguf

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        hf = with_defaults(hf)
        dims, kv_heads = layer_shapes(hf)
        return FamilyConfig(hf, dict(layer_head_dims=dims, layer_kv_heads=kv_heads,
                                     kv_sources=kv_sources(hf)), Gemma4Config.from_hf(hf))


FAMILY = Gemma4()
