"""Qwen3.5 (dense and MoE): the network (model.py) and its gated delta rule (gated_delta.py),
its config (config.py: defaults, layer pattern, refusals, `Qwen3_5Config` with the
recurrent state's shapes); no GGUF map, one rank only, torch only."""

from __future__ import annotations

from typing import Any

from swaserve.models.family import FamilyBase, FamilyConfig
from swaserve.models.qwen3_5.config import Qwen3_5Config, is_moe, with_defaults


class Qwen3_5(FamilyBase):
    name = "qwen3_5"
    one_rank_only = "Gated DeltaNet layers, whose state would split by value head"
    architectures = {"Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",
                     "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
    model_types = ("qwen3_5",)

    def architecture(self, hf: dict[str, Any]) -> str:
        if not hf.get("architectures"):  # a text config named by its model_type
            return "Qwen3_5MoeForCausalLM" if is_moe(hf) else "Qwen3_5ForCausalLM"
        return super().architecture(hf)

    def text_config(self, outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
        if "tie_word_embeddings" in outer:  # the wrapper's, not the text config's
            return {**inner, "tie_word_embeddings": outer["tie_word_embeddings"]}
        return inner

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        hf = with_defaults(hf)
        return FamilyConfig(hf, spec=Qwen3_5Config.from_hf(hf))


FAMILY = Qwen3_5()
