"""Gemma 3 text model (Gemma3ForCausalLM): five sliding layers per full layer, RoPE base 10k
on sliding and 1M on full layers, q/k RMSNorm, Gemma's (1 + w) RMSNorm, scaled embeddings,
GELU-tanh MLP, LM head tied to the embeddings."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.models.attention import AttentionBackend
from swaserve.models.base import CausalLM, DecoderLayerBase
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.layers import add_rms_norm, gelu_tanh_mul, rms_norm
from swaserve.models.weight_map import HF_GATE_UP, HF_QKV, HF_TOP, WeightMap

SINGLE = {
    "self_attn.o_proj.weight": "o", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
NORMS = {"q_norm", "k_norm", "attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm"}


def _fold_norm(target: str, w: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    # Gemma multiplies by (1 + w): fold the 1 in once, in float32 like the reference
    return 1.0 + w.to(p.dtype).float() if target.split(".")[-1] in NORMS | {"final_norm"} else w


WEIGHTS = WeightMap(top=HF_TOP, single=SINGLE, stacked={**HF_QKV, **HF_GATE_UP},
                    transform=_fold_norm)


class Gemma3Layer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        h, d = cfg.hidden_size, cfg.head_dim
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size))
        # norm parameters hold the full multiplier 1 + w, in float32
        for name in NORMS:
            size = d if name in ("q_norm", "k_norm") else h
            setattr(self, name, nn.Parameter(torch.empty(size, dtype=torch.float32)))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext, attn: AttentionBackend, scale: float) -> torch.Tensor:
        qkv = self.project(rms_norm(x, self.attn_norm, self.eps), "qkv", ctx)
        q, k, v = self.heads(qkv, rope, self.q_norm, self.k_norm)
        o = self.project(attn(self.index, q, k, v, ctx, scale), "o", ctx)
        x, h = add_rms_norm(x, o, self.post_attn_norm, self.ffn_norm, self.eps)
        h = self.project(gelu_tanh_mul(self.project(h, "gate_up", ctx)), "down", ctx)
        return add_rms_norm(x, h, self.post_ffn_norm, None, self.eps)[0]


class Gemma3ForCausalLM(CausalLM):
    layer = Gemma3Layer
    weights = WEIGHTS
    scale_embeddings = True
    fused_decode = True  # kernels/decode.c is this layer, kernel for kernel
