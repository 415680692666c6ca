"""The window (SWA) pool: one preallocated ring per request row per sliding layer.

Address scheme: position `p` of row `r` lives at slot `r * ring + p % ring`; one K and one V
buffer of `[rows * ring, kv_heads, head_dim]` per sliding layer (dense sliding index).
`positions[slot]` records the absolute position the slot holds (-1 = empty), shared by all
sliding layers because every layer writes the same positions in the same step. Masks are
built from these positions, never guessed from lengths, and positions stay absolute for RoPE.
A sliding layer therefore never holds more than `ring` tokens of a request.
"""

from __future__ import annotations

import torch

from swaserve.memory.layout import CacheLayout

EMPTY = -1


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        if not any(t is u for u in out):
            out.append(t)
    return out


class WindowPool:
    def __init__(self, layout: CacheLayout, num_rows: int, ring: int,
                 dtype: torch.dtype, device: torch.device | str,
                 kv_device: torch.device | str | None = None):
        kv_device = kv_device or device  # where the K/V data lives (KVCache)
        self.ring = ring
        self.num_rows = num_rows
        self.window = layout.max_window
        self.positions = torch.full((num_rows * ring,), EMPTY, dtype=torch.int64, device=device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i in layout.sliding_layers:
            spec = layout.layers[i]
            shape = (num_rows * ring, spec.num_kv_heads, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=kv_device))
            # K = V layers (DeepSeek-V4) keep one buffer: V is K's
            self.v.append(self.k[-1] if spec.kv_shared
                          else torch.zeros(shape, dtype=dtype, device=kv_device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _unique(self.k + self.v))

    def reset_rows(self, rows: list[int]) -> None:
        """Alloc hook: a new request's rings start empty."""
        for r in rows:
            self.positions[r * self.ring:(r + 1) * self.ring] = EMPTY

    def write(self, dense_layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[dense_layer].index_copy_(0, slots, k)
        self.v[dense_layer].index_copy_(0, slots, v)

    def copy_row(self, src: int, dst: int) -> None:
        """Copy one request's rings into another row (n > 1 continuations share a prompt)."""
        a, b = src * self.ring, dst * self.ring
        self.positions[b:b + self.ring] = self.positions[a:a + self.ring]
        for buf in self.k + self.v:
            buf[b:b + self.ring] = buf[a:a + self.ring]

