"""The compress pool: DeepSeek-V4's compressed-attention state, per request row and
compressed layer (CacheLayout.compressed_layers, each with its CompressSpec).

Two parts per layer, one owner (this class):
- the compress state: the raw kv and gate scores of the tokens that are not pooled yet (and,
  for C4, the window before them, whose first half the next entry pools too). Address
  scheme: position `p` of row `r` at slot `r * span + p % span`, `positions[slot]` the
  absolute position it holds (-1 = empty). A row's ring never holds more than `span` tokens,
  however long its context grows. C4's indexer keeps its own kv and gate at the same slots.
- the compressed entries (and the indexer's keys), paged with the full pool's pages: entry
  `e` of a row (pooled from tokens `[e * rate, (e + 1) * rate)`) at `slot // rate`, `slot`
  the full-pool slot of its first token (req_to_token[row, e * rate]); a page of P tokens
  holds P / rate entries, so pages are shared, forked and freed with the tokens'.
Rings are reset only through the alloc-row hook (`reset_rows`) and copied on forks.
- with the prefix cache, the same raw kv and gate of every cached token, at the window-page
  slots the sliding layers' KV of that token has (written through as the request computes):
  a hit at a page boundary L restores the ring's last `span` positions before L from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swaserve.memory.layout import CacheLayout, CompressSpec
from swaserve.memory.pool import Copy, Costs, Pool, PoolEnv, Sizing
from swaserve.memory.window_pool import restore_slots

if TYPE_CHECKING:
    from swaserve.memory.plan import MemoryPlan
    from swaserve.memory.prefix_cache import Match

EMPTY = -1


@dataclass
class CompressState:
    """One compressed layer's buffers (index_* are empty without an indexer)."""

    spec: CompressSpec
    positions: torch.Tensor  # int64 [rows * span]
    kv: torch.Tensor  # [rows * span, width]
    gate: torch.Tensor  # [rows * span, width]
    entries: torch.Tensor  # [full-pool slots / rate, head_dim]
    index_kv: torch.Tensor  # [rows * span, index_width]
    index_gate: torch.Tensor
    index_entries: torch.Tensor  # [full-pool slots / rate, index_head_dim]

    pages: list[torch.Tensor] | None = None  # kv, gate, index kv, index gate at page slots

    def ring_tensors(self) -> list[torch.Tensor]:
        return [self.positions, self.kv, self.gate, self.index_kv, self.index_gate]

    def entry_tensors(self) -> list[torch.Tensor]:
        return [self.entries, self.index_entries]


def compress_row_bytes(layout: CacheLayout, dtype_bytes: int) -> int:
    """What one request row prepays in the compress pool: its rings (the planner's charge)."""
    return sum(layout.layers[i].compress.ring_bytes(dtype_bytes)
               for i in layout.compressed_layers)


def compress_page_bytes_per_token(layout: CacheLayout, dtype_bytes: int) -> int:
    """What a cached token's raw state costs beside its window pages (prefix cache)."""
    return sum(2 * (layout.layers[i].compress.width + layout.layers[i].compress.index_width)
               * dtype_bytes for i in layout.compressed_layers)


def compress_bytes_per_token(layout: CacheLayout, dtype_bytes: int) -> int:
    """What a token costs in compressed entries and indexer keys (charged with its page)."""
    return sum(layout.layers[i].compress.entry_bytes_per_token(dtype_bytes)
               for i in layout.compressed_layers)


class CompressPool(Pool):
    kind = "compress"

    def __init__(self, layout: CacheLayout, num_rows: int, num_slots: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 index_device: torch.device | str | None = None):
        self.num_rows = num_rows
        self.page_size = page_size
        self.window = layout.max_window
        self.index_device = index_device or device  # where the rings' positions are indexed from
        self.layers: dict[int, CompressState] = {}
        for i in layout.compressed_layers:
            spec = layout.layers[i].compress
            if page_size % spec.rate:
                raise ValueError(f"page_size: {page_size} is not a multiple of layer {i}'s "
                                 f"compress rate {spec.rate} (its entries are paged)")
            ring, entries = num_rows * spec.span, num_slots // spec.rate

            def buf(n: int, width: int) -> torch.Tensor:
                return torch.zeros(n, width, dtype=dtype, device=device)

            self.layers[i] = CompressState(
                spec, torch.full((ring,), EMPTY, dtype=torch.int64, device=device),
                buf(ring, spec.width), buf(ring, spec.width), buf(entries, spec.head_dim),
                buf(ring, spec.index_width), buf(ring, spec.index_width),
                buf(entries, spec.index_head_dim))

    @classmethod
    def declared(cls, layout: CacheLayout) -> bool:
        return bool(layout.compressed_layers)

    @classmethod
    def costs(cls, layout: CacheLayout, sizing: Sizing) -> Costs:
        """Entries and indexer keys a token, a row's rings, a cached token's raw state."""
        b = sizing.dtype_bytes
        return Costs(token=compress_bytes_per_token(layout, b), row=compress_row_bytes(layout, b),
                     cached_token=compress_page_bytes_per_token(layout, b))

    @classmethod
    def create(cls, layout: CacheLayout, plan: MemoryPlan, env: PoolEnv) -> CompressPool:
        pool = cls(layout, plan.num_rows, plan.full_pool_pages * plan.page_size, plan.page_size,
                   env.dtype, env.kv_device, env.device)
        if env.prefix_cache and layout.sliding_layers and plan.window_cache_pages:
            # cached tokens' compress state beside their window pages
            longest = max(layout.layers[i].compress.needed for i in layout.compressed_layers)
            if longest > layout.max_window:  # a hit restores W positions
                raise ValueError(f"prefix_cache: a compressed layer needs {longest} raw "
                                 "tokens at a hit, more than the window "
                                 f"{layout.max_window} the hit restores; turn it off")
            pool.add_pages(plan.window_cache_pages * plan.page_size)
        return pool

    def pool_bytes(self) -> int:
        return self.nbytes()

    def fork(self, src: int, dst: int, num_tokens: int) -> list[Copy] | None:
        self.copy_row(src, dst)
        return []

    def discard(self, row: int, start: int, end: int) -> list[Copy]:
        if end > start:
            self.forget(row, start, end)
        return []

    def copied(self, dst_space: str, dst: torch.Tensor, src_space: str,
               src: torch.Tensor) -> None:
        if dst_space == src_space == "full":  # entries are paged with the full pool's pages
            self.copy_entries(dst, src)

    def add_pages(self, num_slots: int) -> None:
        """Buffers for the raw state of cached tokens, at the prefix cache's window-page
        slots."""
        for s in self.layers.values():
            like = s.kv
            s.pages = [torch.zeros(num_slots, t.shape[1], dtype=like.dtype, device=like.device)
                       for t in (s.kv, s.gate, s.index_kv, s.index_gate)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers.values()
                   for t in s.ring_tensors() + s.entry_tensors() + (s.pages or []))

    def restore(self, row: int, match: Match) -> list[Copy]:
        """A prefix hit: the ring of `row` holds, for each layer, the last `needed`
        positions before the hit, read from their window-page slots."""
        positions, page_slots = restore_slots(match, self.window, self.page_size,
                                              self.index_device)
        for s in self.layers.values():
            span, need = s.spec.span, s.spec.needed
            pos, src = positions[-need:], page_slots[-need:]
            dst = row * span + pos % span
            for ring, page in zip(s.ring_tensors()[1:], s.pages):
                ring[dst] = page[src]
            s.positions[dst] = pos
        return []

    def reset_rows(self, rows: list[int]) -> None:
        """Alloc hook: a new request's rings start empty (its entries are written before
        they are read: entry e exists once position (e + 1) * rate - 1 is computed)."""
        for s in self.layers.values():
            for r in rows:
                s.positions[r * s.spec.span:(r + 1) * s.spec.span] = EMPTY

    def copy_row(self, src: int, dst: int) -> None:
        """Row `dst` continues `src` (n > 1 forks): its rings."""
        for s in self.layers.values():
            span = s.spec.span
            a, b = src * span, dst * span
            for t in s.ring_tensors():
                t[b:b + span] = t[a:a + span]

    def copy_entries(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The entries of full-pool slots `src` into slots `dst` (page copies: a fork's
        partly filled last page), for the slots where an entry starts."""
        for s in self.layers.values():
            start = src % s.spec.rate == 0
            d, f = dst[start] // s.spec.rate, src[start] // s.spec.rate
            for t in s.entry_tensors():
                t[d] = t[f]

    def forget(self, row: int, start: int, end: int) -> None:
        """Positions [start, end) of a row are no longer held (their ring slots empty)."""
        for s in self.layers.values():
            span = s.spec.span
            pos = torch.arange(start, end, device=s.positions.device)
            slots = row * span + pos % span
            held = s.positions[slots] == pos
            s.positions[slots[held]] = EMPTY

    def row_positions(self, layer: int, row: int) -> torch.Tensor:
        """The positions a row's ring holds in one layer, sorted (tests and integrity)."""
        s = self.layers[layer]
        span = s.spec.span
        held = s.positions[row * span:(row + 1) * span]
        return held[held != EMPTY].sort().values

    def check_integrity(self, used_rows: set[int]) -> None:
        """Each used row's ring holds distinct positions within one span, each at its own
        slot."""
        for i, s in self.layers.items():
            span = s.spec.span
            for r in used_rows:
                held = s.positions[r * span:(r + 1) * span]
                slots = torch.nonzero(held != EMPTY).flatten()
                pos = held[slots]
                if pos.numel() and (bool((pos % span != slots).any())
                                    or int(pos.max() - pos.min()) >= span):
                    raise AssertionError(f"compress ring of layer {i}, row {r}: positions "
                                         f"{pos.tolist()} are not one span of {span}")
