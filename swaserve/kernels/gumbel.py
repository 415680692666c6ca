"""The ids of keyed sampling rows that could win their Gumbel-max, from one C pass over the
logits (`gumbel.c`): the bound alone leaves ~25,000 ids a row at temperature 1 to hash in
torch, the hash in C leaves tens."""

from __future__ import annotations

import torch

from swaserve.kernels import build

CAP_PER_ROW = 1 << 14  # candidates a row past which the caller's own path is no slower


def entry():
    return build.function("gumbel", "gumbel_candidates")


def candidates(logits: torch.Tensor, temp: torch.Tensor, best: torch.Tensor,
               prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [R, V] float32 on the CPU, temp [R] float32, best [R] float64 (a score each
    row reaches), prefix [R] int64 (murmur.row_prefix) -> (rows, ids) int64 of every id
    whose score could reach `best`, in row then id order; None when the kernel is absent,
    the inputs are not what it takes, or the ids are too many."""
    if (logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or not logits.is_contiguous()):
        return None
    fn = entry()
    if fn is None:
        return None
    rows, vocab = logits.shape
    temp = temp.to(torch.float32).contiguous()
    best = best.to(torch.float64).contiguous()
    prefix = prefix.to(torch.int64).contiguous()
    cap = min(vocab, CAP_PER_ROW)
    out = torch.empty(rows, cap, dtype=torch.int64)  # row r's ids from out[r, 0]
    count = torch.zeros(rows, dtype=torch.int64)
    rc = fn(logits.data_ptr(), rows, vocab, temp.data_ptr(), best.data_ptr(), prefix.data_ptr(),
            cap, out.data_ptr(), count.data_ptr(), torch.get_num_threads())
    if rc != 0:
        return None
    r = torch.repeat_interleave(torch.arange(rows), count)
    j = torch.arange(len(r)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    return r, out[r, j]
