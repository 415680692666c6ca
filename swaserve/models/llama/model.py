"""Llama-style decoders: Llama 3 (RoPE scaling), Mistral (a window on every layer when
`sliding_window` is set), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

RMSNorm here multiplies by w (not Gemma's 1 + w); the MLP is SiLU-gated; embeddings are
unscaled. Which layers slide comes from the config (CacheLayout), so an all-sliding
Mistral has no full pool and a Llama no window pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.models.attention import AttentionBackend
from swaserve.models.base import CausalLM, DecoderLayerBase
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.layers import add_rms_norm, rms_norm
from swaserve.models.weight_map import HF_GATE_UP, HF_QKV, HF_TOP, WeightMap


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int, qkv_bias: bool, qk_norm: bool):
        super().__init__(cfg, index)
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_bias = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size)) if qkv_bias else None
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size))
        self.attn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.ffn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.q_norm = nn.Parameter(torch.empty(d, dtype=torch.float32)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(d, dtype=torch.float32)) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext, attn: AttentionBackend, scale: float) -> torch.Tensor:
        qkv = self.project(rms_norm(x, self.attn_norm, self.eps), "qkv", ctx)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = self.heads(qkv, rope, self.q_norm, self.k_norm)
        o = self.project(attn(self.index, q, k, v, ctx, scale), "o", ctx)
        x, h = add_rms_norm(x, o, None, self.ffn_norm, self.eps)
        gate, up = self.project(h, "gate_up", ctx).chunk(2, dim=-1)
        return x + self.project(F.silu(gate) * up, "down", ctx)


WEIGHTS = WeightMap(
    top=HF_TOP,
    single={"self_attn.o_proj.weight": "o", "mlp.down_proj.weight": "down",
            "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
            "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"},
    stacked={**HF_QKV, **HF_GATE_UP})

QKV_BIAS = {"Qwen2ForCausalLM"}
QK_NORM = {"Qwen3ForCausalLM"}


class LlamaForCausalLM(CausalLM):
    weights = WEIGHTS

    @staticmethod
    def layer(cfg: ModelConfig, index: int) -> DecoderLayer:
        return DecoderLayer(cfg, index, qkv_bias=cfg.attention_bias or cfg.architecture in QKV_BIAS,
                            qk_norm=cfg.architecture in QK_NORM)
