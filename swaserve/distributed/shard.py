"""What rank r of a tensor-parallel group holds of a model: its local config and its slices
of the checkpoint's tensors, cut by HF name before the model's own loader merges them, so
each rank's parameters are built at their local shapes (never the whole model first).

- q/k/v (column parallel, by head): rank r takes query heads [r H/tp, (r+1) H/tp) and, when
  there are at least tp KV heads, KV heads [r KVH/tp, ...); with fewer it holds the one KV
  head its query heads read (KVH = 1, as Gemma 3 270M: replicated).
- o (row parallel): the input columns of its query heads; the layer all-reduces the sum.
- gate/up (column parallel) and down (row parallel) by the intermediate dimension; for
  gpt-oss's experts the same split inside every expert (TP within experts: each rank keeps
  every expert and the router whole, so routing needs no communication; expert
  parallelism would move tokens between ranks instead, which pays only at many experts per
  rank and a batch large enough to fill them).
- embedding and LM head by vocabulary rows, padded to a split; rank 0 gathers the logits.
- biases that are added once after a sum (down's in gpt-oss's experts) stay on rank 0
  only; everything else (norms, the router, sinks' heads aside) is whole on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from swaserve.checkpoint.config import ModelConfig
from swaserve.distributed.group import vocab_shard


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank builds; raises ValueError naming what does not split."""
    if size == 1:
        return cfg
    h, kvh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % size:
        raise ValueError(f"tensor_parallel_size: {h} attention heads do not split over "
                         f"{size} ranks")
    if (kvh >= size and kvh % size) or (kvh < size and size % kvh):
        raise ValueError(f"tensor_parallel_size: {kvh} KV heads neither split over nor "
                         f"replicate evenly onto {size} ranks")
    if inter % size:
        raise ValueError(f"tensor_parallel_size: the MLP's {inter} columns do not split "
                         f"over {size} ranks")
    return dataclasses.replace(cfg, num_heads=h // size, num_kv_heads=max(1, kvh // size),
                               intermediate_size=inter // size,
                               vocab_size=vocab_shard(cfg.vocab_size, size))


def _rows(t: torch.Tensor, start: int, n: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, n).contiguous()


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, rank: int,
                  size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `rank`'s slice of every (HF name, tensor) of the whole model `cfg`."""
    d = cfg.head_dim
    hl = cfg.num_heads // size
    kvh = cfg.num_kv_heads
    kv_first = rank * (kvh // size) if kvh >= size else rank // (size // kvh)
    kvl = max(1, kvh // size)
    il = cfg.intermediate_size // size
    vl = vocab_shard(cfg.vocab_size, size)
    for name, t in weights:
        leaf = name.rsplit(".", 2)
        tail = ".".join(leaf[-2:])
        if tail in ("q_proj.weight", "q_proj.bias"):
            t = _rows(t, rank * hl * d, hl * d)
        elif tail in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            t = _rows(t, kv_first * d, kvl * d)
        elif tail == "o_proj.weight":
            t = _rows(t, rank * hl * d, hl * d, dim=1)
        elif name.endswith("self_attn.sinks"):
            t = _rows(t, rank * hl, hl)
        elif tail in ("gate_proj.weight", "up_proj.weight"):
            t = _rows(t, rank * il, il)
        elif tail == "down_proj.weight":
            t = _rows(t, rank * il, il, dim=1)
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, hidden, 2I], gate/up interleaved
            t = _rows(t, 2 * rank * il, 2 * il, dim=2)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):  # [E, 2I]
            t = _rows(t, 2 * rank * il, 2 * il, dim=1)
        elif name.endswith("mlp.experts.down_proj"):  # [E, I, hidden]
            t = _rows(t, rank * il, il, dim=1)
        elif name.endswith("mlp.experts.down_proj_bias"):  # added once, after the sum
            t = t if rank == 0 else torch.zeros_like(t)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            part = t[rank * vl:(rank + 1) * vl]
            if part.shape[0] < vl:  # the last rank's padding: rows no token id reaches
                part = torch.cat([part, part.new_zeros(vl - part.shape[0], *part.shape[1:])])
            t = part.contiguous()
        yield name, t
