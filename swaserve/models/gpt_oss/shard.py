"""gpt-oss under tensor parallelism: its sinks by query head, and within every expert the
MLP's split (TP within experts: each rank keeps every expert and the router whole, so
routing needs no communication; expert parallelism would move tokens between ranks
instead, which pays only at many experts per rank and a batch large enough to fill them).
The experts' down bias, added once after the sum, stays on rank 0 only."""

from __future__ import annotations

from swaserve.models.family import Cut, Shapes


def tensor_cut(name: str, shape: tuple[int, ...], cfg: Shapes, rank: int,
               size: int) -> Cut | None:
    hl = cfg.num_heads // size
    il = cfg.intermediate_size // size
    if name.endswith("self_attn.sinks"):
        c, whole = Cut(0, rank * hl, hl), cfg.num_heads
    elif name.endswith("mlp.experts.gate_up_proj"):  # [E, hidden, 2I], gate/up interleaved
        c, whole = Cut(2, 2 * rank * il, 2 * il), 2 * cfg.intermediate_size
    elif name.endswith("mlp.experts.gate_up_proj_bias"):  # [E, 2I]
        c, whole = Cut(1, 2 * rank * il, 2 * il), 2 * cfg.intermediate_size
    elif name.endswith("mlp.experts.down_proj"):  # [E, I, hidden]
        c, whole = Cut(1, rank * il, il), cfg.intermediate_size
    elif name.endswith("mlp.experts.down_proj_bias"):  # added once, after the sum
        return Cut(zeros=True) if rank else None
    else:
        return None
    return c.of(shape, whole)
