"""Batch-invariant Gumbel noise: MurmurHash3 x86_32 over (seed_lo, seed_hi, position, token).

The noise of token `t` at position `p` is a pure function of `(seed, p, t)`, keyed by the
vocabulary id, so a seeded row draws the same token whatever its batchmates, the batch size
or the candidate path. All arithmetic is on int64 tensors kept below 2**48 (multiplications
are split in 16-bit halves), so it is exact on every device.

The noise's one definition: the sampler (sampling/) and the kernels' Python side (screen.py)
read it from here, and murmur.h is the same hash in C.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF
C1, C2 = 0xCC9E2D51, 0x1B873593
F1, F2 = 0x85EBCA6B, 0xC2B2AE35
NOISE_MAX_EXP_CLAMP = 2.0**-32
NOISE_MAX = 32 * math.log(2.0)  # -log(2^-32) = 22.18: no noise value is larger


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & M32) | (x >> (32 - r))


def _block(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl(_mul32(k, C1), 15), C2)
    h = _rotl(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, F1)
    h = h ^ (h >> 13)
    h = _mul32(h, F2)
    return h ^ (h >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    s = seed % 2**64
    return s & M32, s >> 32


def row_prefix(seed_lo: torch.Tensor, seed_hi: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The hash state after the three per-row blocks; [B] int64."""
    h = torch.zeros_like(seed_lo)
    h = _block(h, seed_lo)
    h = _block(h, seed_hi)
    return _block(h, pos & M32)


def murmur_hash(prefix: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """prefix [B] from `row_prefix`, tokens [B, N] or [N] -> 32-bit hashes [B, N] (int64)."""
    if tokens.dim() == 1:
        tokens = tokens[None, :]
    h = _block(prefix[:, None], tokens)
    return _fmix(h ^ 16)


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Gumbel noise in float64: -log(max(-log u, 2^-32)), u = h / (2^32 - 1).
    The clamp keeps u = 1 finite (~22.18); u = 0 gives -inf, never NaN."""
    u = h.double() / float(M32)
    return -torch.log(torch.clamp_min(-torch.log(u), NOISE_MAX_EXP_CLAMP))


def keyed_scores(x: torch.Tensor, temperature: torch.Tensor, prefix: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """float64 Gumbel-max scores of keyed rows, elementwise over [N]: float32(x /
    temperature) (x a float32 logit) plus the noise of (prefix, id)."""
    noise = gumbel_from_hash(murmur_hash(prefix, ids[:, None]))[:, 0]
    return (x.float() / temperature).double() + noise


def keyed_max(rows: torch.Tensor, ids: torch.Tensor, score: torch.Tensor, n: int
              ) -> torch.Tensor:
    """int64 [n]: for each of n rows, the smallest id among its largest scores (as `argmax`
    breaks ties) over (rows, ids, score) triples; -1 for a row with none or only NaN ones."""
    best = torch.full((n,), float("-inf"), dtype=torch.float64, device=score.device)
    best = best.scatter_reduce(0, rows, score, "amax")
    win = score == best[rows]
    first = torch.full((n,), 1 << 62, dtype=torch.int64, device=score.device)
    first = first.scatter_reduce(0, rows[win], ids[win], "amin")
    return torch.where(first < 1 << 62, first, -1)
