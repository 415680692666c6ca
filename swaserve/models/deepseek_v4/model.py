"""DeepSeek-V4: every layer attends a sliding window of one shared K=V head (kept in the
window pool's rings); C4 layers add compressed entries picked per query by the lightning
indexer, C128 layers all their compressed entries (memory/compress_pool.py, the math in
compressor.py). The residual is `hc_mult` streams mixed by hyper-connections
(Sinkhorn-normalised), the MLP a routed MoE (top-k by score plus a bias, or hashed by token
id) beside one shared expert, the output projection grouped and low-rank.

Refused until they work: tensor parallelism, MLX, the MTP layer (as a draft source),
embeddings."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.models.base import CausalLM
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.deepseek_v4.compressor import (
    Branch,
    Indexer,
    Lin,
    Norm,
    Seq,
    attend,
    entry_slots,
    fp32_buffer,
    record_positions,
    rope,
    update_branch,
)
from swaserve.models.deepseek_v4.config import DeepseekV4Config
from swaserve.models.deepseek_v4.moe import MoE
from swaserve.models.layers import rope_inv_freq


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        spec: DeepseekV4Config = cfg.spec
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index = index
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.groups, self.eps = spec.o_groups, eps
        rank, o_rank = spec.q_lora_rank, spec.o_lora_rank
        self.q_a_proj, self.q_a_norm = Lin(hidden, rank), Norm(rank, eps)
        self.q_b_proj = Lin(rank, self.num_heads * self.head_dim)
        self.kv_proj, self.kv_norm = Lin(hidden, self.head_dim), Norm(self.head_dim, eps)
        per_group = self.num_heads * self.head_dim // self.groups
        self.o_a_proj = Lin(per_group, self.groups * o_rank)
        self.o_b_proj = Lin(self.groups * o_rank, hidden)
        fp32_buffer(self, "sinks", self.num_heads)
        kind = spec.attention_types[index]
        self.compressed = kind != "sliding_attention"
        self.rope_kind = "compress" if self.compressed else "main"
        if self.compressed:
            csa = kind == "compressed_sparse_attention"
            rate = spec.compress_rates[kind]
            self.compressor = Branch(hidden, self.head_dim, rate, csa, eps)
            if csa:
                # compressor.py's Indexer reads the config dict itself
                self.compressor.indexer = Indexer(cfg, rate)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, model: DeepseekV4ForCausalLM,
                seqs: list[Seq]) -> torch.Tensor:
        cache = model.attn.cache
        cos, sin = model.rope_cs[self.rope_kind]
        t = x.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_res).view(t, self.num_heads, self.head_dim), self.eps)
        q = rope(q, cos[:, None], sin[:, None])
        kv = rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        dense = cache.layout.dense_index(self.index)
        writes = ctx.view("window")
        cache.window.write(dense, writes.slots, kv[:, None], kv[:, None])
        if writes.pages is not None:  # the prefix cache's copy of the sliding KV
            idx, wslots = writes.pages
            cache.window_pages.write(dense, wslots, kv[idx, None], kv[idx, None])
        state = cache.compress.layers[self.index] if self.compressed else None
        if state is not None:
            self._compress(x, seqs, state, model, cache.rows.req_to_token, ctx)
        buf = cache.window.k[dense][:, 0]
        out = torch.empty_like(q)
        for s in seqs:
            keys, allowed = _sliding_keys(s, kv, buf)
            pos = ctx.positions[s.start:s.end]
            if state is not None:
                comp, comp_allowed = self._entries(x, q_res, pos, s, state, model)
                keys, allowed = torch.cat([keys, comp]), torch.cat([allowed, comp_allowed], 1)
            out[s.start:s.end] = attend(q[s.start:s.end], keys, allowed, self.sinks,
                                        self.head_dim ** -0.5)
        out = rope(out, cos[:, None], -sin[:, None])  # undo the values' rotation
        grouped = out.reshape(t, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).reshape(t, -1))

    def _compress(self, x: torch.Tensor, seqs: list[Seq], state, model,
                  table: torch.Tensor, ctx: ForwardContext) -> None:
        """Each branch's projections of the step's tokens: written through to the prefix
        cache's pages where the step has window pages, then pooled sequence by sequence."""
        comp = self.compressor
        branches = [(comp, state.kv, state.gate, state.entries)]
        if hasattr(comp, "indexer"):
            branches.append((comp.indexer, state.index_kv, state.index_gate,
                             state.index_entries))
        projected = []
        for k, (branch, *_) in enumerate(branches):
            kv, gate = branch.kv_proj(x), branch.gate_proj(x)
            pages = ctx.view("window").pages
            if pages is not None and state.pages is not None:
                idx, slots = pages
                state.pages[2 * k][slots] = kv[idx].to(state.pages[0].dtype)
                state.pages[2 * k + 1][slots] = gate[idx].to(state.pages[0].dtype)
            projected.append((kv, gate))
        for s in seqs:
            for (branch, ring_kv, ring_gate, entries), (kv, gate) in zip(branches, projected):
                update_branch(branch, kv[s.start:s.end], gate[s.start:s.end], s, state,
                              ring_kv, ring_gate, entries, table, model.compress_rope)
            record_positions(state, s)

    def _entries(self, x, q_res, pos, s: Seq, state, model) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed entries a sequence's queries may read [E, D] and which each reads."""
        rate = state.spec.rate
        ne = (s.first + s.n) // rate
        slots = entry_slots(model.attn.cache.rows.req_to_token, s, rate, 0, ne)
        slots = slots.to(state.entries.device)
        entries = state.entries[slots]
        allowed = torch.arange(ne, device=pos.device)[None, :] < ((pos + 1) // rate)[:, None]
        indexer = getattr(self.compressor, "indexer", None)
        if indexer is not None and ne:
            keys = state.index_entries[slots]
            cs = tuple(c[s.start:s.end] for c in model.rope_cs["compress"])
            allowed = indexer.select(x[s.start:s.end], q_res[s.start:s.end], pos, keys, cs)
        return entries, allowed


def _sliding_keys(s: Seq, kv: torch.Tensor, buf: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's window keys [L, D] (its fresh rows or its ring slots) and which of them
    each query sees [n, L]."""
    view = s.group.sliding
    if view.fresh:
        keys = kv[s.start:s.end]
    else:
        keys = buf[view.key_slots[s.b]]
    n, width = s.n, keys.shape[0]
    if view.mask is not None:
        allowed = view.mask[s.b if view.mask.shape[0] > 1 else 0, 0].expand(n, width)
    elif view.causal:
        allowed = torch.ones(n, width, dtype=torch.bool, device=kv.device).tril(width - n)
    else:
        allowed = torch.ones(n, width, dtype=torch.bool, device=kv.device)
    return keys, allowed


class HyperConnection(nn.Module):
    """`hc_mult` residual streams: collapse them for the block (pre), spread its output
    back (post) and mix the streams (comb, Sinkhorn-normalised), all from the streams."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        spec: DeepseekV4Config = cfg.spec
        self.hc, self.iters = spec.hc_mult, spec.hc_sinkhorn_iters
        self.eps, self.norm_eps = spec.hc_eps, cfg.rms_norm_eps
        fp32_buffer(self, "fn", (2 + self.hc) * self.hc, self.hc * cfg.hidden_size)
        fp32_buffer(self, "base", (2 + self.hc) * self.hc)
        fp32_buffer(self, "scale", 3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc, eps = self.hc, self.eps
        flat = unweighted_rms(h.reshape(h.shape[0], -1).float(), self.norm_eps)
        pre, post, comb = F.linear(flat, self.fn).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post * self.scale[1] + post_b)
        comb = torch.softmax(comb.view(-1, hc, hc) * self.scale[2] + comb_b.view(hc, hc),
                             dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
              ) -> torch.Tensor:
        dt = h.dtype
        return (post.to(dt).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dt).transpose(-1, -2), h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.index = index
        # moe.py's MoE reads the config dict itself
        self.self_attn, self.mlp = Attention(cfg, index), MoE(cfg, index)
        self.input_layernorm = Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = Norm(cfg.hidden_size, eps)
        self.attn_hc, self.ffn_hc = HyperConnection(cfg), HyperConnection(cfg)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, model: DeepseekV4ForCausalLM,
                seqs: list[Seq]) -> torch.Tensor:
        post, comb, x = self.attn_hc(h)
        out = self.self_attn(self.input_layernorm(x), ctx, model, seqs)
        h = HyperConnection.merge(h, out, post, comb)
        post, comb, x = self.ffn_hc(h)
        out = self.mlp(self.post_attention_layernorm(x), ctx.input_ids)
        return HyperConnection.merge(h, out, post, comb)


class HyperHead(nn.Module):
    """The final collapse of the streams into one, before the final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hc = cfg.spec.hc_mult
        self.eps, self.norm_eps = cfg.spec.hc_eps, cfg.rms_norm_eps
        fp32_buffer(self, "hc_fn", hc, hc * cfg.hidden_size)
        fp32_buffer(self, "hc_base", hc)
        fp32_buffer(self, "hc_scale", 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(h.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


# checkpoint names (DeepSeek's own, or transformers') onto this module tree, in order
TOP = {"embed.weight": "embed", "embed_tokens.weight": "embed", "head.weight": "lm_head",
       "lm_head.weight": "lm_head", "norm.weight": "final_norm", "hc_head_fn": "hc_head.hc_fn",
       "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
RENAMES = [(re.compile(a), b) for a, b in (
    (r"^(layers\.\d+\.)attn\.", r"\1self_attn."), (r"^(layers\.\d+\.)ffn\.", r"\1mlp."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.self_attn\.indexer\.", ".self_attn.compressor.indexer."),
    (r"\.scorer\.weights_proj\.", ".weights_proj."), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.w([123])\.weight$")


def module_name(name: str) -> str:
    """A checkpoint tensor's path in this module tree."""
    name = name.removeprefix("model.")
    if name in TOP:
        return TOP[name]
    for pattern, repl in RENAMES:
        name = pattern.sub(repl, name)
    return name


class DeepseekV4ForCausalLM(CausalLM):
    layer = DecoderLayer
    runs_on_mlx = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        spec: DeepseekV4Config = cfg.spec
        self.hc_mult = spec.hc_mult
        self.hc_head = HyperHead(cfg)
        self.rope_tables = {
            kind: rope_inv_freq(spec.rope_dim, float(section["rope_theta"]),
                                section if section.get("rope_type") == "yarn" else None)
            for kind, section in (("main", spec.rope_main), ("compress", spec.rope_compress))}
        self.rope_cs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors onto the parameters and float32 buffers (DeepSeek's names or
        transformers'; per-expert w1 / w3 / w2 stacked into gate_up / down); every one must
        be filled. The MTP layer's tensors (`mtp.*`) are not used."""
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        want = set(targets)
        per_expert: dict[str, dict[int, torch.Tensor]] = {}
        for name, w in weights:
            if name.startswith(("mtp.", "model.mtp.")):
                continue
            key = module_name(name)
            m = EXPERT.match(key)
            if m:  # experts.<e>.w1 (gate), w3 (up), w2 (down), stacked once all are read
                stack, e, which = m.group(1), int(m.group(2)), m.group(3)
                target = stack + (".down_proj" if which == "2" else ".gate_up_proj")
                t = targets[target]
                inter = t.shape[1] // 2 if which != "2" else None
                rows = slice(0, inter) if which == "1" else slice(inter, None) if inter else None
                with torch.no_grad():
                    (t[e] if rows is None else t[e, rows]).copy_(w)
                per_expert.setdefault(target, {})[e * 2 + (which == "3")] = True
                if len(per_expert[target]) == t.shape[0] * (1 if which == "2" else 2):
                    want.discard(target)
                continue
            if key not in targets:
                raise ValueError(f"{name}: not a DeepSeek-V4 tensor swaserve knows")
            if tuple(targets[key].shape) != tuple(w.shape):
                raise ValueError(f"{name}: shape {tuple(w.shape)}, expected "
                                 f"{tuple(targets[key].shape)}")
            with torch.no_grad():
                targets[key].copy_(w)
            want.discard(key)
        if want:
            raise ValueError(f"checkpoint lacks {sorted(want)[:5]}")

    def set_tensor_parallel(self, group) -> None:
        raise ValueError("tensor_parallel_size: DeepSeek-V4 runs on one rank only")

    def encode(self, ctx: ForwardContext, attn) -> torch.Tensor:
        raise ValueError("embeddings are not implemented for DeepSeek-V4")

    def compress_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos_sin("compress", positions)

    def _cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv, scale = self.rope_tables[kind]
        freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
        return freqs.cos() * scale, freqs.sin() * scale

    def run_layers(self, x: torch.Tensor, rope_unused: dict, ctx: ForwardContext) -> torch.Tensor:
        self.rope_cs = {kind: self._cos_sin(kind, ctx.positions) for kind in self.rope_tables}
        seqs = _sequences(ctx, self.attn.cache.window.ring)
        h = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            h = layer(h, ctx, self, seqs)
        return self.hc_head(h)


def _sequences(ctx: ForwardContext, ring: int) -> list[Seq]:
    out = []
    starts = ctx.view("window").slots.tolist()
    first = ctx.positions.tolist()
    for g in ctx.groups:
        for b in range(g.batch):
            s = g.start + b * g.num_queries
            out.append(Seq(s, g.num_queries, starts[s] // ring, first[s], g, b))
    return out
