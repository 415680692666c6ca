"""gpt-oss (GptOssForCausalLM): sliding (W = 128) and full layers alternating, a learned
attention sink per head, YaRN RoPE, biases on q/k/v/o, and a top-k routed MoE whose experts
use the clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)` with g = clamp(gate).

Checkpoints come as bf16 tensors or with MXFP4 expert weights (`*_blocks` + `*_scales`:
two E2M1 values per byte, low nibble first, times 2^(scale - 127) per 32 values), which
are dequantized on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from swaserve.models.attention import AttentionBackend
from swaserve.models.base import CausalLM, DecoderLayerBase
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.gpt_oss.config import GptOssConfig
from swaserve.models.layers import linear, rms_norm, rows_in_blocks
from swaserve.models.weight_map import HF_QKV, HF_TOP, WeightMap

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> float32 [E, G * 32, rows]
    (transposed to the [experts, in, out] layout the bf16 checkpoints use)."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8).to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [E, rows, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    return vals.flatten(-2).transpose(1, 2).contiguous()


def _with_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                pending.setdefault(base, {})[suffix] = w
                if len(pending[base]) == 2:
                    parts = pending.pop(base)
                    yield base, dequantize_mxfp4(parts["_blocks"], parts["_scales"])
                break
        else:
            yield name, w
    if pending:
        raise ValueError(f"MXFP4 weights without their pair: {', '.join(sorted(pending))}")


class GptOssLayer(DecoderLayerBase):
    TP_REDUCE = ("o",)  # the experts' sum is reduced once, at the end of `moe`

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        spec: GptOssConfig = cfg.spec
        h = cfg.hidden_size
        e, inter = spec.num_local_experts, cfg.intermediate_size
        self.top_k = spec.experts_per_token
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit
        self.qkv_bias = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size))
        self.o_bias = nn.Parameter(torch.empty(h))
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32))
        self.attn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.ffn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.router = nn.Parameter(torch.empty(e, h))
        self.router_bias = nn.Parameter(torch.empty(e))
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * inter))  # gate/up interleaved
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * inter))
        self.down = nn.Parameter(torch.empty(e, inter, h))
        self.down_bias = nn.Parameter(torch.empty(e, h))

    def moe(self, x: torch.Tensor, row_block: int | None) -> torch.Tensor:
        logits = linear(x, self.router, row_block) + self.router_bias
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            gu = _matmul(x[tok], self.gate_up[e], row_block) + self.gate_up_bias[e]
            gate = gu[:, ::2].clamp(max=self.limit)
            up = gu[:, 1::2].clamp(-self.limit, self.limit)
            y = (_matmul((up + 1) * gate * torch.sigmoid(gate * self.alpha), self.down[e],
                         row_block) + self.down_bias[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext, attn: AttentionBackend, scale: float) -> torch.Tensor:
        q, k, v = self.heads(linear(rms_norm(x, self.attn_norm, self.eps), self.qkv,
                                    ctx.row_block) + self.qkv_bias, rope)
        o = attn(self.index, q, k, v, ctx, scale, sinks=self.sinks)
        x = x + self.project(o, "o", ctx) + self.o_bias
        return x + self.moe(rms_norm(x, self.ffn_norm, self.eps), ctx.row_block)


def _matmul(a: torch.Tensor, b: torch.Tensor, row_block: int | None) -> torch.Tensor:
    return a @ b if row_block is None else rows_in_blocks(lambda part: part @ b, a, row_block)


WEIGHTS = WeightMap(
    top=HF_TOP,
    single={"self_attn.o_proj.weight": "o", "self_attn.o_proj.bias": "o_bias",
            "self_attn.sinks": "sinks", "input_layernorm.weight": "attn_norm",
            "post_attention_layernorm.weight": "ffn_norm", "mlp.router.weight": "router",
            "mlp.router.bias": "router_bias", "mlp.experts.gate_up_proj": "gate_up",
            "mlp.experts.gate_up_proj_bias": "gate_up_bias", "mlp.experts.down_proj": "down",
            "mlp.experts.down_proj_bias": "down_bias"},
    stacked=HF_QKV)


class GptOssForCausalLM(CausalLM):
    layer = GptOssLayer
    weights = WEIGHTS

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_with_mxfp4(weights))

    @staticmethod
    def dense_weights(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterable[tuple[str, torch.Tensor]]:
        return _with_mxfp4(weights)
