"""What rank r of a tensor-parallel group holds of a model: its local config and its slices
of the checkpoint's tensors, cut by HF name before the model's own loader merges them, so
each rank's parameters are built at their local shapes (never the whole model first) and,
from safetensors (an HF checkpoint, or a GGUF's dequantized cache), read as slices of the
memory-mapped file: a rank reads its part of each tensor, not the tensor.

- q/k/v (column parallel, by head): rank r takes query heads [r H/tp, (r+1) H/tp) and, when
  there are at least tp KV heads, KV heads [r KVH/tp, ...); with fewer it holds the one KV
  head its query heads read (KVH = 1, as Gemma 3 270M: replicated).
- o (row parallel): the input columns of its query heads; the layer all-reduces the sum.
- gate/up (column parallel) and down (row parallel) by the intermediate dimension.
- embedding and LM head by vocabulary rows, padded to a split; rank 0 gathers the logits.
- a family's own tensors as its `Family.tensor_cut` says (gpt-oss's experts and sinks:
  models/gpt_oss/shard.py); everything else (norms, the router) is whole on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from swaserve.checkpoint.source import ModelSource
from swaserve.checkpoint.weights import iter_weights
from swaserve.models.config import ModelConfig
from swaserve.models.family import Cut


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of the embedding and LM head on each rank (the last is padded with zeros)."""
    return -(-vocab_size // size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank builds; raises ValueError naming what does not split."""
    if size == 1:
        return cfg
    if cfg.family is not None:
        cfg.family.check_tensor_parallel(cfg, size)
    if not cfg.uniform_attention:
        raise ValueError(f"tensor_parallel_size: {cfg.architecture} (per-layer head shapes, "
                         "KV shared across layers, per-layer inputs) runs on one rank only")
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


def cut_for(name: str, shape: tuple[int, ...], cfg: ModelConfig, rank: int,
            size: int) -> Cut | None:
    """Rank `rank`'s cut of the whole model's tensor `name`, or None when it keeps the
    tensor as it is: a replicated tensor, or one that is already this rank's slice (every
    cut is shorter than the whole along its dim, so cutting twice is cutting once)."""
    d = cfg.head_dim
    hl = cfg.num_heads // size
    kvh = cfg.num_kv_heads
    kv_first = rank * (kvh // size) if kvh >= size else rank // (size // kvh)
    kvl = max(1, kvh // size)
    il = cfg.intermediate_size // size
    vl = vocab_shard(cfg.vocab_size, size)
    tail = ".".join(name.rsplit(".", 2)[-2:])
    if tail in ("q_proj.weight", "q_proj.bias"):
        c, whole = Cut(0, rank * hl * d, hl * d), cfg.num_heads * d
    elif tail in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        c, whole = Cut(0, kv_first * d, kvl * d), kvh * d
    elif tail == "o_proj.weight":
        c, whole = Cut(1, rank * hl * d, hl * d), cfg.num_heads * d
    elif tail in ("gate_proj.weight", "up_proj.weight"):
        c, whole = Cut(0, rank * il, il), cfg.intermediate_size
    elif tail == "down_proj.weight":
        c, whole = Cut(1, rank * il, il), cfg.intermediate_size
    elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
        c, whole = Cut(0, rank * vl, vl), cfg.vocab_size
    elif cfg.family is not None:  # the family's own tensors (gpt-oss's experts, sinks)
        return cfg.family.tensor_cut(name, shape, cfg, rank, size)
    else:
        return None
    return c.of(shape, whole)


def apply_cut(t: torch.Tensor, c: Cut | None) -> torch.Tensor:
    if c is None:
        return t
    if c.zeros:
        return torch.zeros_like(t)
    part = t.narrow(c.dim, c.start, max(0, min(c.length, t.shape[c.dim] - c.start)))
    return pad_cut(part, c)


def pad_cut(part: torch.Tensor, c: Cut) -> torch.Tensor:
    """A cut that ran past the tensor's end (the last vocabulary shard), padded with zero
    rows that no token id reaches."""
    missing = c.length - part.shape[c.dim]
    if missing:
        pad = list(part.shape)
        pad[c.dim] = missing
        part = torch.cat([part, part.new_zeros(pad)], dim=c.dim)
    return part.contiguous()


def sharded_weights(source: ModelSource, dtype: torch.dtype, cfg: ModelConfig, rank: int,
                    size: int, dense: Callable[[Iterable], Iterable]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `rank`'s slice of every (HF name, tensor) of the whole model `cfg`: read as a
    slice where the checkpoint stores the tensor plainly, cut after `dense` (the family's
    unpacking, e.g. gpt-oss's MXFP4 experts) where it does not."""
    cuts: dict[str, Cut] = {}

    def part(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        c = cut_for(name, shape, cfg, rank, size)
        if c is None or c.zeros:
            return None
        cuts[name] = c
        return (slice(None),) * c.dim + (slice(c.start, c.start + c.length),)

    for name, t in dense(iter_weights(source, dtype, part)):
        c = cuts.pop(name, None)
        if c is not None:  # read as this rank's slice already: only the padding is left
            yield name, pad_cut(t, c)
        else:
            yield name, apply_cut(t, cut_for(name, tuple(t.shape), cfg, rank, size))
