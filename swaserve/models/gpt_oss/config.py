"""gpt-oss's own config fields: its routed experts and their clamped SwiGLU, with the
defaults of OpenAI's reference where config.json leaves them out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GptOssConfig:
    num_local_experts: int
    experts_per_token: int  # `num_experts_per_tok`, or the reference's `experts_per_token`
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GptOssConfig:
        return cls(num_local_experts=int(hf["num_local_experts"]),
                   experts_per_token=int(hf.get("num_experts_per_tok",
                                                hf.get("experts_per_token", 4))),
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
