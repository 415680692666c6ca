"""Qwen3.5 text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, or the text model of their
ForConditionalGeneration checkpoints: the vision tower and the MTP head are not read).

Two kinds of layers, both with Qwen's (1 + w) RMSNorm (folded at load) and a SiLU-gated MLP
(or, in the MoE variant, routed SiLU experts beside a sigmoid-gated shared expert):
- Gated DeltaNet ("linear_attention", 3 of every 4 layers): one projection gives the q/k/v
  channels, the output gate z and the per-head rate b and decay a; q/k/v pass a depthwise
  causal convolution (SiLU) and the gated delta rule (gated_delta.py) from the
  request's state in the state pool (memory/state_pool.py), which they leave updated; the
  output is RMS-normed per head, gated by SiLU(z) and projected. No KV is kept.
- gated full attention: q (with a per-head output gate beside it in q_proj's rows), k and
  v; q and k RMS-normed per head, the first `partial_rotary_factor` of each head rotated
  (text positions: every mrope section the same), attention over the paged full pool, the
  output times sigmoid(gate) before o_proj.

Which runs of tokens a step feeds the recurrent layers, and from and into which state
slots, comes from the state pool's view of the step (`ForwardContext.view("state")`,
engine/runner.py). An encoder forward (no such view) takes each group as a whole prompt from a zero state and keeps nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.models.attention import AttentionBackend
from swaserve.models.base import CausalLM, DecoderLayerBase
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext, RecurrentBatch
from swaserve.models.layers import add_rms_norm, apply_rope, linear, rms_norm, rope_inv_freq
from swaserve.models.qwen3_5 import gated_delta
from swaserve.models.qwen3_5.config import Qwen3_5Config
from swaserve.models.weight_map import HF_GATE_UP, HF_QKV, HF_TOP, WeightMap

# Qwen's RMSNorm multiplies by (1 + w): these hold the full multiplier (folded at load)
ONE_PLUS = {"attn_norm", "ffn_norm", "q_norm", "k_norm", "final_norm"}


class MLPMixin:
    """The SiLU-gated MLP, or in the MoE variant the MoE block: softmax router, top k
    renormalized, SiLU experts, plus a shared expert (`gate_up`, `down`) gated by
    sigmoid(x . shared_gate). Its parameters live on the layer."""

    def init_mlp(self, cfg: ModelConfig) -> None:
        h, spec = cfg.hidden_size, cfg.spec
        self.moe = spec.moe
        if not self.moe:
            self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h))
            self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size))
            return
        e, inter = spec.num_experts, spec.moe_intermediate_size
        shared = spec.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.expert_inter = e, spec.num_experts_per_tok, inter
        self.router = nn.Parameter(torch.empty(e, h))
        # experts stacked along dim 0: gate_up rows [2e I, 2(e+1) I) (gate, then up), down
        # rows [e h, (e+1) h)
        self.experts_gate_up = nn.Parameter(torch.empty(e * 2 * inter, h))
        self.experts_down = nn.Parameter(torch.empty(e * h, inter))
        self.gate_up = nn.Parameter(torch.empty(2 * shared, h))
        self.down = nn.Parameter(torch.empty(h, shared))
        self.shared_gate = nn.Parameter(torch.empty(1, h))

    def mlp(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, up = self.project(h, "gate_up", ctx).chunk(2, dim=-1)
        out = self.project(F.silu(gate) * up, "down", ctx)
        if not self.moe:
            return out
        out = torch.sigmoid(linear(h, self.shared_gate, ctx.row_block)) * out
        return self.experts(h, ctx.row_block) + out

    def experts(self, h: torch.Tensor, row_block: int | None) -> torch.Tensor:
        logits = linear(h, self.router, row_block)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
        inter, hidden = self.expert_inter, h.shape[-1]
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            gate, up = linear(h[tok], self.experts_gate_up[e * 2 * inter:(e + 1) * 2 * inter],
                              row_block).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, self.experts_down[e * hidden:(e + 1) * hidden],
                       row_block)
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out


class AttentionLayer(DecoderLayerBase, MLPMixin):
    """Gated full attention: q_proj's rows are [q | gate] per head."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        h, d = cfg.hidden_size, self.head_dim
        self.qkv = nn.Parameter(torch.empty(2 * self.q_size + 2 * self.kv_size, h))
        self.rot = cfg.spec.rotary_dim
        for name, size in (("attn_norm", h), ("ffn_norm", h), ("q_norm", d), ("k_norm", d)):
            setattr(self, name, nn.Parameter(torch.empty(size, dtype=torch.float32)))
        self.init_mlp(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext, attn: AttentionBackend, scale: float) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.project(rms_norm(x, self.attn_norm, self.eps), "qkv", ctx)
        qg = qkv[:, :2 * self.q_size].view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.q_size)
        k = qkv[:, 2 * self.q_size:2 * self.q_size + self.kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, 2 * self.q_size + self.kv_size:].view(t, self.num_kv_heads, d)
        q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = self._rotate(q, rope), self._rotate(k, rope)
        o = attn(self.index, q, k, v.contiguous(), ctx, scale) * torch.sigmoid(gate)
        x, h = add_rms_norm(x, self.project(o, "o", ctx), None, self.ffn_norm, self.eps)
        return x + self.mlp(h, ctx)

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope
        if self.rot == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :self.rot], cos, sin), x[..., self.rot:]], dim=-1)


class GatedDeltaLayer(nn.Module, MLPMixin):
    """A Gated DeltaNet layer and its MLP."""

    TP_REDUCE: tuple[str, ...] = ()
    tp = None
    sliding = False

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        spec: Qwen3_5Config = cfg.spec
        h = cfg.hidden_size
        self.index = index
        self.dense = sum(1 for t in cfg.layer_types[:index] if t == "linear")
        self.hk, self.hv = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.kernel = spec.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.channels = 2 * self.key_dim + self.value_dim
        self.eps = cfg.rms_norm_eps
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a stacked: one product
        self.in_proj = nn.Parameter(torch.empty(self.channels + self.value_dim + 2 * self.hv, h))
        self.conv = nn.Parameter(torch.empty(self.channels, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.a_log = nn.Parameter(torch.empty(self.hv))
        self.out = nn.Parameter(torch.empty(h, self.value_dim))
        # the gated norm's multiplier is w itself (no 1 + w)
        self.gated_norm = nn.Parameter(torch.empty(self.dv, dtype=torch.float32))
        self.attn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.ffn_norm = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.init_mlp(cfg)
        self.q8: dict = {}

    def project(self, x: torch.Tensor, name: str, ctx: ForwardContext) -> torch.Tensor:
        return linear(x, getattr(self, name), ctx.row_block, self.q8.get(name), ctx.q8_kernel)

    def forward(self, x: torch.Tensor, rope, ctx: ForwardContext, attn, scale: float
                ) -> torch.Tensor:
        t = x.shape[0]
        proj = self.project(rms_norm(x, self.attn_norm, self.eps), "in_proj", ctx)
        mixed, z, b, a = proj.split([self.channels, self.value_dim, self.hv, self.hv], dim=-1)
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(t, self.hv, self.dv, dtype=x.dtype, device=x.device)
        runs = ctx.view("state")
        if runs is None:
            self._fresh(mixed, g, beta, core, ctx)
        else:
            self._stateful(mixed, g, beta, core, runs)
        o = self._gated_norm(core, z)
        x, h = add_rms_norm(x, self.project(o, "out", ctx), None, self.ffn_norm, self.eps)
        return x + self.mlp(h, ctx)

    # -- the recurrence over a step's runs ---------------------------------------------------
    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B, C, N] conv output -> q, k [B, N, Hk, Dk] and v [B, N, Hv, Dv]."""
        y = conv_out.transpose(1, 2)
        bsz, n = y.shape[0], y.shape[1]
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(bsz, n, self.hk, self.dk), k.reshape(bsz, n, self.hk, self.dk),
                v.reshape(bsz, n, self.hv, self.dv))

    def _run(self, x: torch.Tensor, conv_state: torch.Tensor, ssm: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, keep_states: bool = False):
        """Runs of N tokens x [B, N, C] from their states: (out [B, N, Hv, Dv], conv inputs
        [B, C, K - 1 + N], final state, kept states)."""
        conv_out, inputs = gated_delta.causal_conv(x.transpose(1, 2), conv_state, self.conv)
        q, k, v, g, beta = gated_delta.heads_first(*self._split(conv_out), g, beta)
        if x.shape[1] == 1 or keep_states:
            out, state, kept = gated_delta.recurrent(q, k, v, g, beta, ssm, keep_states)
        else:
            out, state = gated_delta.chunked(q, k, v, g, beta, ssm)
            kept = []
        return out.transpose(1, 2).to(x.dtype), inputs, state, kept

    def _stateful(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  core: torch.Tensor, rb: RecurrentBatch) -> None:
        conv_buf, ssm_buf = rb.pool.conv[self.dense], rb.pool.ssm[self.dense]
        w = self.kernel - 1
        if rb.single_tokens is not None:
            idx, slots = rb.single_tokens, rb.single_slots
            out, inputs, state, _ = self._run(mixed[idx][:, None], conv_buf[slots],
                                              ssm_buf[slots], g[idx][:, None],
                                              beta[idx][:, None])
            core[idx] = out[:, 0]
            conv_buf[slots] = inputs[..., 1:].to(conv_buf.dtype)
            ssm_buf[slots] = state
        for s in rb.seqs:
            a, n = s.start, s.num_tokens
            cuts = [c for c, _ in s.saves] + [n]
            conv_state, state, done = conv_buf[s.slot][None], ssm_buf[s.slot][None], 0
            for c, slot in zip(cuts, [sl for _, sl in s.saves] + [s.slot]):
                seg = slice(a + done, a + c)
                out, inputs, state, kept = self._run(
                    mixed[seg][None], conv_state, state, g[seg][None], beta[seg][None],
                    keep_states=s.snapshots is not None)
                core[seg] = out[0]
                conv_state = inputs[..., c - done:c - done + w]
                conv_buf[slot] = conv_state[0].to(conv_buf.dtype)
                ssm_buf[slot] = state[0]
                for j, snap in enumerate(s.snapshots or ()):
                    conv_buf[snap] = inputs[0, :, j + 1:j + 1 + w].to(conv_buf.dtype)
                    ssm_buf[snap] = kept[j][0]
                done = c
        if rb.after is not None:
            dst, src = rb.after
            conv_buf[dst] = conv_buf[src]
            ssm_buf[dst] = ssm_buf[src]

    def _fresh(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               core: torch.Tensor, ctx: ForwardContext) -> None:
        """Each group a whole prompt from a zero state (an encoder forward)."""
        for grp in ctx.groups:
            seg = slice(grp.start, grp.end)
            conv0 = mixed.new_zeros(1, self.channels, self.kernel - 1)
            ssm0 = torch.zeros(1, self.hv, self.dk, self.dv, dtype=torch.float32,
                               device=mixed.device)
            core[seg] = self._run(mixed[seg][None], conv0, ssm0, g[seg][None],
                                  beta[seg][None])[0][0]

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS-norm each head's output (float32), times w in the model dtype, times
        SiLU(z), as transformers' RMSNormGated."""
        dtype = core.dtype
        y = core.reshape(-1, self.dv).float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.gated_norm.to(dtype) * y.to(dtype)
        y = y * F.silu(z.reshape(-1, self.dv).float())
        return y.to(dtype).reshape(core.shape[0], self.value_dim)


def _shard_sizes(layer: nn.Module, pname: str) -> list[int]:
    if pname == "qkv":
        return [2 * layer.q_size, layer.kv_size, layer.kv_size]
    if pname == "in_proj":
        return [layer.channels, layer.value_dim, layer.hv, layer.hv]
    if pname == "gate_up":
        return [layer.gate_up.shape[0] // 2] * 2
    if pname == "experts_gate_up":
        return [layer.expert_inter] * (2 * layer.num_experts)
    if pname == "experts_down":
        return [layer.down.shape[0]] * layer.num_experts
    raise ValueError(f"{pname}: not a merged parameter")


def _transform(target: str, w: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    name = target.split(".")[-1]
    if name in ONE_PLUS:  # fold Qwen's 1 + w in once, in float32 like the reference
        return 1.0 + w.to(p.dtype).float()
    if name == "conv":  # [C, 1, K] -> [C, K]
        return w.reshape(p.shape)
    if name in ("experts_gate_up", "experts_down") and w.dim() == 3:  # fused [E, ., .]
        return w.reshape(p.shape)
    return w


SINGLE = {
    "self_attn.o_proj.weight": "o", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "linear_attn.conv1d.weight": "conv", "linear_attn.dt_bias": "dt_bias",
    "linear_attn.A_log": "a_log", "linear_attn.norm.weight": "gated_norm",
    "linear_attn.out_proj.weight": "out",
    # MoE: the shared expert, the router and the shared expert's gate
    "mlp.shared_expert.down_proj.weight": "down", "mlp.gate.weight": "router",
    "mlp.shared_expert_gate.weight": "shared_gate",
    # fused expert tensors, as transformers keeps them
    "mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down",
}
STACKED = {
    **HF_QKV, **HF_GATE_UP,
    "linear_attn.in_proj_qkv.weight": ("in_proj", 0), "linear_attn.in_proj_z.weight": ("in_proj", 1),
    "linear_attn.in_proj_b.weight": ("in_proj", 2), "linear_attn.in_proj_a.weight": ("in_proj", 3),
    "mlp.shared_expert.gate_proj.weight": ("gate_up", 0),
    "mlp.shared_expert.up_proj.weight": ("gate_up", 1),
}


def weight_map(num_experts: int) -> WeightMap:
    """The name map; per-expert checkpoint tensors (experts.E.gate_proj ...) land in the
    stacked expert parameters."""
    stacked = dict(STACKED)
    for e in range(num_experts):
        stacked[f"mlp.experts.{e}.gate_proj.weight"] = ("experts_gate_up", 2 * e)
        stacked[f"mlp.experts.{e}.up_proj.weight"] = ("experts_gate_up", 2 * e + 1)
        stacked[f"mlp.experts.{e}.down_proj.weight"] = ("experts_down", e)
    return WeightMap(top=HF_TOP, single=SINGLE, stacked=stacked, shard_sizes=_shard_sizes,
                     transform=_transform)


class Qwen3_5ForCausalLM(CausalLM):
    weights = weight_map(0)
    runs_on_mlx = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        spec: Qwen3_5Config = cfg.spec
        inv = rope_inv_freq(spec.rotary_dim, cfg.rope_theta)  # partial RoPE: the first dims
        self.rope = {False: inv, True: inv}
        if spec.moe:
            self.weights = weight_map(spec.num_experts)

    @staticmethod
    def layer(cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.layer_types[index] == "linear":
            return GatedDeltaLayer(cfg, index)
        return AttentionLayer(cfg, index)

    def set_tensor_parallel(self, group) -> None:
        raise ValueError("tensor_parallel_size: Qwen3.5 runs on one rank only")
