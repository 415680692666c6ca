"""The window (SWA) pool: one preallocated ring per request row per sliding layer.

Address scheme: position `p` of row `r` lives at slot `r * ring + p % ring`; one K and one V
buffer of `[rows * ring, kv_heads, head_dim]` per sliding layer (dense sliding index), with
their scales when the KV is quantized (memory/kv_quant.py).
`positions[slot]` records the absolute position the slot holds (-1 = empty), shared by all
sliding layers because every layer writes the same positions in the same step. Masks are
built from these positions, never guessed from lengths, and positions stay absolute for RoPE.
A sliding layer therefore never holds more than `ring` tokens of a request.
"""

from __future__ import annotations

import torch

from swaserve.memory.kv_quant import KVBuffers, KVFormat
from swaserve.memory.layout import CacheLayout

EMPTY = -1


class WindowPool(KVBuffers):
    def __init__(self, layout: CacheLayout, num_rows: int, ring: int,
                 fmt: KVFormat, device: torch.device | str,
                 kv_device: torch.device | str | None = None):
        kv_device = kv_device or device  # where the K/V data lives (KVCache)
        self.ring = ring
        self.num_rows = num_rows
        self.window = layout.max_window
        self.positions = torch.full((num_rows * ring,), EMPTY, dtype=torch.int64, device=device)
        # K = V layers (DeepSeek-V4) keep one buffer: V is K's
        super().__init__([(num_rows * ring, layout.layers[i].num_kv_heads,
                           layout.layers[i].head_dim) for i in layout.sliding_layers],
                         fmt, kv_device, [layout.layers[i].kv_shared for i in layout.sliding_layers])

    def reset_rows(self, rows: list[int]) -> None:
        """Alloc hook: a new request's rings start empty."""
        for r in rows:
            self.positions[r * self.ring:(r + 1) * self.ring] = EMPTY

    def copy_row(self, src: int, dst: int) -> None:
        """Copy one request's rings into another row (n > 1 continuations share a prompt)."""
        a, b = src * self.ring, dst * self.ring
        self.positions[b:b + self.ring] = self.positions[a:a + self.ring]
        for buf in self.buffers():
            buf[b:b + self.ring] = buf[a:a + self.ring]

