"""Gemma 4 (dense and MoE): the network (model.py), its config (config.py: defaults, per-layer
shapes, KV sources, refusals, `Gemma4Config`) and GGUF map (gguf.py); one rank only, torch
only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from swaserve.models.family import FamilyBase, FamilyConfig, Tensors
from swaserve.models.gemma4 import gguf
from swaserve.models.gemma4.config import Gemma4Config, kv_sources, layer_shapes, with_defaults

if TYPE_CHECKING:
    from swaserve.models.config import ModelConfig


class Gemma4(FamilyBase):
    name = "gemma4"
    architectures = {"Gemma4ForCausalLM": "Gemma4ForCausalLM",
                     "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}
    model_types = ("gemma4",)
    gguf_architectures = gguf.ARCHITECTURES

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        hf = with_defaults(hf)
        dims, kv_heads = layer_shapes(hf)
        return FamilyConfig(hf, dict(layer_head_dims=dims, layer_kv_heads=kv_heads,
                                     kv_sources=kv_sources(hf)), Gemma4Config.from_hf(hf))

    def check_tensor_parallel(self, cfg: ModelConfig, size: int) -> None:
        raise ValueError(f"tensor_parallel_size: {cfg.architecture} (per-layer head shapes, "
                         "KV shared across layers, per-layer inputs) runs on one rank only")

    def model_class(self, architecture: str) -> type:
        from swaserve.models.gemma4.model import Gemma4ForCausalLM

        return Gemma4ForCausalLM

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        return gguf.config_from_gguf(meta, arch)

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        return gguf.tensors_from_gguf(arch, hf, tensors)


FAMILY = Gemma4()
