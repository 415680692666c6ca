"""DeepSeek-V4's compressed attention, over the per-row state of memory/compress_pool.py:
the compressor (one entry per `rate` tokens: a softmax over each window's gate scores plus a
learned per-offset bias weighs its kv; C4 pools two overlapping windows), the lightning
indexer (C4: which entries each query reads), and the attention of a sequence over its
sliding window and its entries in one softmax with the head's sink.

Entries are a function of the tokens of their windows alone, so a chunk computes the
windows it closes from the ring's earlier tokens and its own, whatever the chunking."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.memory.compress_pool import CompressState
from swaserve.models.config import ModelConfig
from swaserve.models.layers import rms_norm


class Lin(nn.Module):
    """A bias-free projection whose weight loads by its HF name (`<module>.weight`)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Norm(nn.Module):
    """RMSNorm with a float32 multiplier (a buffer, so loading never narrows it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fp32_buffer(module: nn.Module, name: str, *shape: int) -> None:
    module.register_buffer(name, torch.zeros(*shape, dtype=torch.float32))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] channels of x [..., D] (cos, sin
    broadcast to x's leading dims, one value per channel pair), computed in float32."""
    rd = 2 * cos.shape[-1]
    nope, r = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = r[..., 0::2], r[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@dataclass
class Seq:
    """One sequence of the step: rows [start, start + n) of the flattened batch, its request
    row, its first position, and its attention group (`b` within it)."""

    start: int
    n: int
    row: int
    first: int
    group: object
    b: int

    @property
    def end(self) -> int:
        return self.start + self.n


class Branch(nn.Module):
    """One compressor (the attention's entries, or the indexer's keys): kv and gate
    projections to `width` channels per token, a per-offset gate bias, the entries' norm."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = head_dim * (2 if overlap else 1)
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj, self.gate_proj = Lin(hidden, width), Lin(hidden, width)
        self.kv_norm = Norm(head_dim, eps)
        fp32_buffer(self, "position_bias", rate, width)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int) -> torch.Tensor:
        """Entries of the consecutive windows whose tokens `kv`, `gate` [tokens, width] hold
        from window `first_window` on; with overlap they start one window earlier (none at
        window 0), whose first half joins the first entry."""
        r, d = self.rate, self.head_dim
        prev = self.overlap and first_window > 0
        kv = kv.view(-1, r, kv.shape[-1])
        gate = gate.view(-1, r, gate.shape[-1]) + self.position_bias
        if not self.overlap:
            weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
            return self.kv_norm((kv * weights).sum(dim=1))
        if prev:  # window i pools its own second half and window i - 1's first half
            cur_kv, cur_gate, old_kv, old_gate = (kv[1:, :, d:], gate[1:, :, d:],
                                                  kv[:-1, :, :d], gate[:-1, :, :d])
        else:  # window 0 has no predecessor: a zero kv with weight 0
            cur_kv, cur_gate = kv[:, :, d:], gate[:, :, d:]
            old_kv = torch.cat([kv.new_zeros(1, r, d), kv[:-1, :, :d]])
            old_gate = torch.cat([gate.new_full((1, r, d), float("-inf")), gate[:-1, :, :d]])
        both_kv, both_gate = torch.cat([old_kv, cur_kv], 1), torch.cat([old_gate, cur_gate], 1)
        weights = both_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((both_kv * weights).sum(dim=1))


def entry_slots(table: torch.Tensor, seq: Seq, rate: int, first: int, end: int
                ) -> torch.Tensor:
    """Where a row's entries [first, end) live: the full-pool slot of each one's first token,
    over `rate` (memory/compress_pool.py)."""
    starts = torch.arange(first, end, device=table.device) * rate
    return table[seq.row, starts] // rate


def update_branch(branch: Branch, kv: torch.Tensor, gate: torch.Tensor, seq: Seq,
                  state: CompressState, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                  entries: torch.Tensor, table: torch.Tensor, rope_of) -> None:
    """Pool the windows one sequence's new tokens (their projections `kv`, `gate`) close,
    with the ring's earlier tokens, write those entries and keep the newest tokens in the
    ring. The ring's positions are updated by the caller, once for both branches."""
    spec, r = state.spec, branch.rate
    first_w, end_w = seq.first // r, (seq.first + seq.n) // r
    if end_w > first_w:
        lo = max(first_w * r - (r if branch.overlap else 0), 0)
        if lo < seq.first:  # earlier tokens of these windows wait in the ring
            pos = torch.arange(lo, seq.first, device=state.positions.device)
            slots = seq.row * spec.span + pos % spec.span
            if not bool((state.positions[slots] == pos).all()):
                raise RuntimeError("compress ring lost tokens a window still needs")
            kv = torch.cat([ring_kv[slots], kv])
            gate = torch.cat([ring_gate[slots], gate])
        n_tok = end_w * r - lo
        pooled = branch.pool(kv[:n_tok], gate[:n_tok], first_w)
        wpos = torch.arange(first_w, end_w, device=kv.device) * r
        cos, sin = rope_of(wpos)
        pooled = rope(pooled, cos, sin)
        entries[entry_slots(table, seq, r, first_w, end_w).to(entries.device)] = pooled
        kv, gate = kv[-seq.n:], gate[-seq.n:]
    keep = min(seq.n, spec.span)
    pos = torch.arange(seq.first + seq.n - keep, seq.first + seq.n, device=state.positions.device)
    slots = seq.row * spec.span + pos % spec.span
    ring_kv[slots] = kv[-keep:].to(ring_kv.dtype)
    ring_gate[slots] = gate[-keep:].to(ring_gate.dtype)


def record_positions(state: CompressState, seq: Seq) -> None:
    keep = min(seq.n, state.spec.span)
    pos = torch.arange(seq.first + seq.n - keep, seq.first + seq.n,
                       device=state.positions.device)
    state.positions[seq.row * state.spec.span + pos % state.spec.span] = pos


class Indexer(Branch):
    """The lightning indexer: its own compressor at `index_head_dim`, and per query the
    score sum_h w_h * relu(q_h . key) of each entry; a query reads its top `index_topk`,
    the earliest of equal scores first."""

    def __init__(self, cfg: ModelConfig, rate: int):
        spec, hidden = cfg.spec, cfg.hidden_size
        super().__init__(hidden, spec.index_head_dim, rate, True, cfg.rms_norm_eps)
        self.num_heads, self.topk = spec.index_n_heads, spec.index_topk
        self.q_b_proj = Lin(spec.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Lin(hidden, self.num_heads)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor, rope_cs) -> torch.Tensor:
        """bool [n, entries]: the entries each of the sequence's queries reads."""
        n, ne = x.shape[0], keys.shape[0]
        q = self.q_b_proj(q_residual).view(n, self.num_heads, self.head_dim)
        cos, sin = rope_cs
        q = rope(q, cos[:, None], sin[:, None])
        scores = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float()))
        scores = scores * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.num_heads ** -0.5
        scores = (scores * w[..., None]).sum(dim=1)
        limit = (positions + 1) // self.rate
        valid = torch.arange(ne, device=x.device)[None, :] < limit[:, None]
        scores = scores.masked_fill(~valid, float("-inf"))
        # Equal scores (relu leaves many exactly 0) go to the earliest entries: topk's order
        # among them depends on the row's width, i.e. on where the chunk ends.
        kth = scores.topk(min(self.topk, ne), dim=-1).values[:, -1:]
        above, tied = scores > kth, scores == kth
        room = min(self.topk, ne) - above.sum(dim=-1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(dim=-1) <= room))
        return chosen & valid


def attend(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [n, H, D] over K=V keys [L, D] where `allowed` [n, L], with one sink logit per head
    in the softmax's denominator: [n, H, D]."""
    scores = torch.einsum("nhd,ld->hnl", q, keys) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum("hnl,ld->nhd", probs, keys)
