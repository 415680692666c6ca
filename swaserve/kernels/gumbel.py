"""The ids of keyed sampling rows that could win their Gumbel-max, from one C pass over the
logits (`gumbel.c`): the bound alone leaves tens of thousands of ids a row at temperature 1
to hash in torch, the hash in C leaves tens. Filtering rows (top-k, top-p, min-p) the same from their
kept sets, found without sorting the vocabulary."""

from __future__ import annotations

import torch

from swaserve.kernels import build

CAP_PER_ROW = 1 << 14  # candidates a row past which the caller's own path is no slower


def entry():
    return build.function("gumbel", "gumbel_candidates")


def readable(logits: torch.Tensor) -> bool:
    """The logits are what the kernels read: float32 [B, V] on the CPU, contiguous."""
    return (logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.dim() == 2 and logits.is_contiguous())


def _flat(out: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids) of each row r's first count[r] ids of out[r]."""
    r = torch.repeat_interleave(torch.arange(out.shape[0]), count)
    j = torch.arange(len(r)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    return r, out[r, j]


def candidates(logits: torch.Tensor, temp: torch.Tensor, best: torch.Tensor,
               prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [R, V] float32 on the CPU, temp [R] float32, best [R] float64 (a score each
    row reaches), prefix [R] int64 (murmur.row_prefix) -> (rows, ids) int64 of every id
    whose score could reach `best`, in row then id order; None when the kernel is absent,
    the inputs are not what it takes, or the ids are too many."""
    fn = entry() if readable(logits) else None
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
    return _flat(out, count) if rc == 0 else None


def nucleus_entry():
    return build.function("gumbel", "nucleus_candidates")


def nucleus_candidates(logits: torch.Tensor, rows: list[int], temp: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       prefix: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For filtering rows `rows` of logits [B, V] (float32, CPU, contiguous) with their
    temperature, top_k (V: all), top_p, min_p and murmur prefix ([R] each): (r, ids) int64
    of every id of a row's kept set whose score could reach its best, in row then id order
    (r indexes `rows`), and settled [R] bool: the rows the kernel took (the others: a NaN,
    a kept set past its buckets, too many candidates). None when the kernel is absent or
    the logits are not what it takes."""
    fn = nucleus_entry() if readable(logits) else None
    if fn is None:
        return None
    n, vocab = len(rows), logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64)
    args = [a.to(dt).contiguous() for a, dt in ((temp, torch.float32), (top_k, torch.int64),
                                                 (top_p, torch.float32), (min_p, torch.float32),
                                                 (prefix, torch.int64))]
    cap = min(vocab, CAP_PER_ROW)
    out = torch.empty(n, cap, dtype=torch.int64)
    count = torch.empty(n, dtype=torch.int64)
    fn(logits.data_ptr(), index.data_ptr(), n, vocab, *(a.data_ptr() for a in args), cap,
       out.data_ptr(), count.data_ptr(), torch.get_num_threads())
    return (*_flat(out, count.clamp(min=0)), count >= 0)
