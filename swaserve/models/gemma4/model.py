"""Gemma 4 text model (Gemma4ForCausalLM), dense and MoE.

What it adds to Gemma 3's shape:
- per-kind attention shapes: full layers with their own head size (`global_head_dim`) and
  RoPE (proportional: only a quarter of the frequencies rotate), sliding layers the smaller
  head; with `attention_k_eq_v` a full layer has no value projection: its values are the
  key projection's output, RMS-normed without a scale (keys are normed and rotated), so the
  cache still holds two different tensors;
- values RMS-normed (no scale) on every layer, attention scores unscaled (q and k are
  normed), plain RMSNorm multipliers (no 1 + w);
- KV shared across layers: the last `num_kv_shared_layers` layers compute no K/V; each reads
  the K/V of its source layer (the last earlier layer of its kind, CacheLayout.kv_source)
  from this step and from the source's ring or pages; such layers may have a double-wide MLP;
- per-layer inputs: a `[vocab_size_per_layer_input, layers x P]` embedding plus a projection
  of the token embedding, one P-wide slice per layer, gated into the residual after the MLP;
- a learned `layer_scalar` on each layer's output, and the final logits soft-capped;
- MoE variants (`enable_moe_block`): routed GeGLU experts beside each layer's dense MLP,
  both outputs normed and summed before the post-MLP norm."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.models.attention import AttentionBackend
from swaserve.models.base import CausalLM, DecoderLayerBase
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.gemma4.config import Gemma4Config
from swaserve.models.layers import add_rms_norm, apply_rope, gelu_tanh_mul, linear, rms_norm
from swaserve.models.weight_map import HF_GATE_UP, HF_QKV, HF_TOP, WeightMap

SINGLE = {
    "self_attn.o_proj.weight": "o", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
    "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "ple_gate", "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm",
    # the MoE block beside the MLP (enable_moe_block)
    "router.proj.weight": "router", "router.scale": "router_scale",
    "router.per_expert_scale": "expert_scale", "experts.gate_up_proj": "experts_gate_up",
    "experts.down_proj": "experts_down", "pre_feedforward_layernorm_2.weight": "ffn2_norm",
    "post_feedforward_layernorm_1.weight": "post_ffn1_norm",
    "post_feedforward_layernorm_2.weight": "post_ffn2_norm",
}
TOP = {**HF_TOP, "embed_tokens_per_layer.weight": "ple_embed",
       "per_layer_model_projection.weight": "ple_model_proj",
       "per_layer_projection_norm.weight": "ple_proj_norm"}


def _shard_sizes(layer: nn.Module, pname: str) -> list[int]:
    """q, k, v as the layer has them: q and k on a K=V layer, q alone on a reusing one."""
    if pname == "qkv":
        return [layer.q_size] + [layer.kv_size] * layer.kv_parts
    return [layer.gate_up.shape[0] // 2] * 2


WEIGHTS = WeightMap(top=TOP, single=SINGLE, stacked={**HF_QKV, **HF_GATE_UP},
                    shard_sizes=_shard_sizes)


class Gemma4Layer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        h, d = cfg.hidden_size, self.head_dim
        spec: Gemma4Config = cfg.spec
        self.kv_source = cfg.kv_source_of(index)
        k_eq_v = spec.attention_k_eq_v and not self.sliding
        self.kv_parts = 0 if self.kv_source is not None else (1 if k_eq_v else 2)
        self.qkv = nn.Parameter(torch.empty(self.q_size + self.kv_parts * self.kv_size, h))
        wide = 2 if spec.use_double_wide_mlp and self.kv_source is not None else 1
        inter = cfg.intermediate_size * wide
        self.gate_up = nn.Parameter(torch.empty(2 * inter, h))
        self.down = nn.Parameter(torch.empty(h, inter))
        norms = {"q_norm": d, "attn_norm": h, "post_attn_norm": h, "ffn_norm": h,
                 "post_ffn_norm": h}
        if self.kv_parts:
            norms["k_norm"] = d
        self.k_norm = None
        ple = spec.hidden_size_per_layer_input
        self.ple = ple
        if ple:
            self.ple_gate = nn.Parameter(torch.empty(ple, h))
            self.ple_proj = nn.Parameter(torch.empty(h, ple))
            norms["ple_norm"] = h
        self.moe = spec.enable_moe_block
        if self.moe:
            e, moe_inter = spec.num_experts, spec.moe_intermediate_size
            self.top_k = spec.top_k_experts
            self.router = nn.Parameter(torch.empty(e, h))
            self.router_scale = nn.Parameter(torch.empty(h))
            self.expert_scale = nn.Parameter(torch.empty(e))
            self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * moe_inter, h))
            self.experts_down = nn.Parameter(torch.empty(e, h, moe_inter))
            norms.update(ffn2_norm=h, post_ffn1_norm=h, post_ffn2_norm=h)
        for name, size in norms.items():  # multipliers as they are (no 1 + w), in float32
            setattr(self, name, nn.Parameter(torch.empty(size, dtype=torch.float32)))
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.is_source = False  # set by the model: a later layer reads this one's K/V

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext, attn: AttentionBackend, scale: float,
                ple_input: torch.Tensor | None,
                shared: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.project(rms_norm(x, self.attn_norm, self.eps), "qkv", ctx)
        cos, sin = rope
        q = qkv[:, :self.q_size].reshape(t, self.num_heads, self.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm, self.eps), cos, sin)
        if self.kv_parts:
            k_raw = qkv[:, self.q_size:self.q_size + self.kv_size]
            v_raw = k_raw if self.kv_parts == 1 else qkv[:, self.q_size + self.kv_size:]
            k_raw = k_raw.reshape(t, self.num_kv_heads, self.head_dim)
            v_raw = v_raw.reshape(t, self.num_kv_heads, self.head_dim)
            k = apply_rope(rms_norm(k_raw, self.k_norm, self.eps), cos, sin)
            v = F.rms_norm(v_raw.float(), (self.head_dim,), None, self.eps).to(v_raw.dtype)
            if self.is_source:
                shared[self.index] = (k, v)
        else:
            k, v = shared[self.kv_source]
        o = self.project(attn(self.index, q, k, v, ctx, scale), "o", ctx)
        x, h = add_rms_norm(x, o, self.post_attn_norm, self.ffn_norm, self.eps)
        h = self.project(gelu_tanh_mul(self.project(h, "gate_up", ctx)), "down", ctx)
        if self.moe:  # the routed experts beside the MLP, each output normed, summed
            h = (rms_norm(h, self.post_ffn1_norm, self.eps)
                 + rms_norm(self.experts(x, ctx.row_block), self.post_ffn2_norm, self.eps))
        x = add_rms_norm(x, h, self.post_ffn_norm, None, self.eps)[0]
        if self.ple:
            g = F.gelu(self.project(x, "ple_gate", ctx), approximate="tanh") * ple_input
            x = add_rms_norm(x, self.project(g, "ple_proj", ctx), self.ple_norm, None,
                             self.eps)[0]
        return x * self.layer_scalar


    def experts(self, x: torch.Tensor, row_block: int | None) -> torch.Tensor:
        """The MoE block over the post-attention residual `x`: a router over `x` normed
        without a multiplier (softmax, top k, renormalized, times each expert's scale), and
        the chosen GeGLU experts over `x` normed by `ffn2_norm`."""
        r = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        r = r * self.router_scale * x.shape[-1] ** -0.5
        probs = torch.softmax(linear(r, self.router, row_block).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scale[idx]
        h = rms_norm(x, self.ffn2_norm, self.eps)
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            y = linear(gelu_tanh_mul(linear(h[tok], self.experts_gate_up[e], row_block)),
                       self.experts_down[e], row_block)
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out


class Gemma4ForCausalLM(CausalLM):
    layer = Gemma4Layer
    weights = WEIGHTS
    scale_embeddings = True
    runs_on_mlx = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.scale = 1.0  # q and k are RMS-normed: scores are not scaled
        n, h = cfg.num_layers, cfg.hidden_size
        spec: Gemma4Config = cfg.spec
        self.ple = spec.hidden_size_per_layer_input
        if self.ple:
            vocab = spec.vocab_size_per_layer_input or cfg.vocab_size
            self.ple_embed = nn.Parameter(torch.empty(vocab, n * self.ple))
            self.ple_model_proj = nn.Parameter(torch.empty(n * self.ple, h))
            self.ple_proj_norm = nn.Parameter(torch.empty(self.ple, dtype=torch.float32))
        for s in cfg.kv_sources:
            if s is not None:
                self.layers[s].is_source = True

    def set_tensor_parallel(self, group) -> None:
        raise ValueError("tensor_parallel_size: Gemma 4 runs on one rank only")

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, P]: each token's row of the per-layer table (scaled by sqrt(P)) and
        a normed projection of its embedding `x`, averaged with weight 1/sqrt(2) each."""
        if not self.ple:
            return None
        t, n = ids.shape[0], self.cfg.num_layers
        tok = F.embedding(ids, self.ple_embed)
        tok = tok * torch.tensor(math.sqrt(self.ple), dtype=tok.dtype)
        proj = linear(x, self.ple_model_proj) * self.cfg.hidden_size ** -0.5
        proj = rms_norm(proj.reshape(t, n, self.ple), self.ple_proj_norm, self.cfg.rms_norm_eps)
        return (proj + tok.reshape(t, n, self.ple)) * 2.0 ** -0.5

    def run_layers(self, x: torch.Tensor, rope: dict, ctx: ForwardContext) -> torch.Tensor:
        ple = self.per_layer_inputs(ctx.input_ids, x)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope[layer.sliding], ctx, self.attn, self.scale,
                      None if ple is None else ple[:, i], shared)
        return x
