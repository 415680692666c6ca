"""DeepSeek-V4's MLP: routed experts (top-k by `sqrtsoftplus` or `sigmoid` score plus a
learned bias, or a fixed expert list per token id in `hash_moe` layers), weighted by their
normalised scores times `routed_scaling_factor`, beside one shared expert; SwiGLU with the
gate and up pre-activations clamped at `swiglu_limit`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.models.config import ModelConfig
from swaserve.models.deepseek_v4.compressor import Lin, fp32_buffer


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        spec, experts, hidden = cfg.spec, cfg.spec.n_routed_experts, cfg.hidden_size
        self.top_k, self.hashed = spec.num_experts_per_tok, hashed
        self.scoring, self.scaling = spec.scoring_func, spec.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if hashed:  # the experts of each token id, fixed
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k,
                                                        dtype=torch.int64))
        else:
            fp32_buffer(self, "e_score_correction_bias", experts)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.hashed:
            idx = self.tid2eid[ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj, self.up_proj = Lin(hidden, inter), Lin(hidden, inter)
        self.down_proj, self.limit = Lin(inter, hidden), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.limit = limit

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, k = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
            out.index_add_(0, tok, (F.linear(h, self.down_proj[e]) * w[tok, k, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        spec = cfg.spec
        hidden, inter, limit = cfg.hidden_size, spec.moe_intermediate_size, spec.swiglu_limit
        self.gate = Router(cfg, spec.mlp_layer_types[index] == "hash_moe")
        self.experts = Experts(spec.n_routed_experts, hidden, inter, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, ids)
        return self.experts(x, idx, w) + self.shared_experts(x)
