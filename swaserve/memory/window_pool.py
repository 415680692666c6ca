"""The window (SWA) pool: one preallocated ring per request row per sliding layer.

Address scheme: position `p` of row `r` lives at slot `r * ring + p % ring`; one K and one V
buffer of `[rows * ring, kv_heads, head_dim]` per sliding layer (dense sliding index), with
their scales when the KV is quantized (memory/kv_quant.py).
`positions[slot]` records the absolute position the slot holds (-1 = empty), shared by all
sliding layers because every layer writes the same positions in the same step. Masks are
built from these positions, never guessed from lengths, and positions stay absolute for RoPE.
A sliding layer therefore never holds more than `ring` tokens of a request.

With the prefix cache the pool also owns the window pages (memory/prefix_cache.py
`WindowPagePool`: the sliding layers' KV of cached tokens, written through as requests
compute). Per row it keeps, in position order, the window pages the row writes through to
(`row_pages`, None where none was free to give), ref-counted with the prefix tree's.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from swaserve.memory.kv_quant import KVBuffers, KVFormat
from swaserve.memory.layout import CacheLayout
from swaserve.memory.pool import Copy, Costs, Pool, PoolEnv, Sizing, held_pages
from swaserve.memory.prefix_cache import WindowPagePool

if TYPE_CHECKING:
    from swaserve.memory.plan import MemoryPlan
    from swaserve.memory.prefix_cache import Match
    from swaserve.memory.rows import RequestRows

EMPTY = -1


def sliding_bytes_per_token(layout: CacheLayout, dtype_bytes: int, scale_bytes: int = 0) -> int:
    """KV bytes a token costs in the sliding layers that store it (each at its own shape);
    `scale_bytes` per KV head when quantized."""
    return sum(layout.layers[i].kv_bytes_per_token(dtype_bytes, scale_bytes)
               for i in layout.sliding_layers)


def restore_slots(match: Match, window: int, page_size: int,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, window-page slots) of the last `window` positions before a hit, the
    ones a hit restores into a row's rings."""
    lo = max(0, match.num_tokens - window)
    pos = torch.arange(lo, match.num_tokens)
    wp = torch.tensor([match.window_pages[i // page_size] for i in range(lo, match.num_tokens)],
                      dtype=torch.int64)
    return pos.to(device), (wp * page_size + pos % page_size).to(device)


class WindowPool(KVBuffers, Pool):
    kind = "window"

    def __init__(self, layout: CacheLayout, num_rows: int, ring: int,
                 fmt: KVFormat, device: torch.device | str,
                 kv_device: torch.device | str | None = None,
                 rows: RequestRows | None = None, pages: WindowPagePool | None = None):
        kv_device = kv_device or device  # where the K/V data lives (KVCache)
        self.ring = ring
        self.num_rows = num_rows
        self.window = layout.max_window
        self.rows = rows
        self.positions = torch.full((num_rows * ring,), EMPTY, dtype=torch.int64, device=device)
        self.pages = pages  # the prefix cache's window pages (None without)
        self.row_pages: dict[int, list[int | None]] = {}
        # K = V layers (DeepSeek-V4) keep one buffer: V is K's
        super().__init__([(num_rows * ring, layout.layers[i].num_kv_heads,
                           layout.layers[i].head_dim) for i in layout.sliding_layers],
                         fmt, kv_device, [layout.layers[i].kv_shared for i in layout.sliding_layers])

    @classmethod
    def declared(cls, layout: CacheLayout) -> bool:
        return bool(layout.sliding_layers)

    @classmethod
    def costs(cls, layout: CacheLayout, sizing: Sizing) -> Costs:
        """A row's rings and their recorded positions (int64, shared by the sliding
        layers); a cached token's window-page KV."""
        per_token = sliding_bytes_per_token(layout, sizing.dtype_bytes, sizing.scale_bytes)
        return Costs(row=sizing.ring * (per_token + 8), cached_token=per_token)

    @classmethod
    def create(cls, layout: CacheLayout, plan: MemoryPlan, env: PoolEnv) -> WindowPool:
        pages = None
        if env.prefix_cache and plan.window_cache_pages:
            pages = WindowPagePool(layout, plan.window_cache_pages, plan.page_size,
                                   env.kv_format, env.kv_device)
        return cls(layout, plan.num_rows, plan.ring, env.kv_format, env.device, env.kv_device,
                   env.rows, pages)

    def pool_bytes(self) -> int:
        pages = self.pages.nbytes() if self.pages is not None else 0
        return self.nbytes() + self.positions.numel() * 8 + pages

    def reset_rows(self, rows: list[int]) -> None:
        """Alloc hook: a new request's rings start empty."""
        for r in rows:
            self.positions[r * self.ring:(r + 1) * self.ring] = EMPTY
            self.row_pages[r] = []

    # -- window pages --------------------------------------------------------------------
    def _page_need(self, row: int, num_tokens: int) -> int:
        return -(-num_tokens // self.pages.page_size) - len(self.row_pages[row])

    def free_row(self, row: int) -> None:
        held = [w for w in self.row_pages.pop(row) if w is not None]
        if held:
            self.pages.allocator.decref(held)

    def ensure(self, row: int, num_tokens: int) -> bool:
        """Window pages to write through to, as many as are free after evicting cached
        prefixes (a position without one is not cached)."""
        if self.pages is None:
            return True
        need = self._page_need(row, num_tokens)
        if need > 0:
            alloc = self.pages.allocator
            if alloc.num_free < need:
                self.prefix.evict(window_pages=need)
            got = alloc.alloc(min(need, alloc.num_free)) or []
            self.row_pages[row].extend(got + [None] * (need - len(got)))
        return True

    def fits_free(self, row: int, num_tokens: int) -> bool:
        return self.pages is None or (self._page_need(row, num_tokens)
                                      <= self.pages.allocator.num_free)

    def write_slots(self, row: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """(offsets within [start, start + n), window-page slots) for the positions of a row
        that have a window page to write through to."""
        if self.pages is None:
            return [], []
        p = self.pages.page_size
        wp = self.row_pages[row]
        offs, slots = [], []
        for pos in range(start, start + n):
            w = wp[pos // p]
            if w is not None:
                offs.append(pos - start)
                slots.append(w * p + pos % p)
        return offs, slots

    # -- drafts and forks ----------------------------------------------------------------
    def discard(self, row: int, start: int, end: int) -> list[Copy]:
        """The ring slots of [start, end) hold no position any more; window pages past
        those that positions [0, start + 1) use go back."""
        if end <= start:
            return []
        slots = row * self.ring + torch.arange(start, end) % self.ring
        self.positions[slots.to(self.positions.device)] = EMPTY
        if self.pages is not None:
            keep = -(-(start + 1) // self.pages.page_size)
            pages = self.row_pages[row]
            extra = [w for w in pages[keep:] if w is not None]
            if extra:
                self.pages.allocator.decref(extra)
            del pages[keep:]
        return []

    def fork(self, src: int, dst: int, num_tokens: int) -> list[Copy] | None:
        """The rings are copied; whole window pages are final and shared."""
        if self.pages is not None:
            shared = self.row_pages[src][:num_tokens // self.pages.page_size]
            self.pages.allocator.incref([w for w in shared if w is not None])
            self.row_pages[dst] = list(shared)
        a, b = src * self.ring, dst * self.ring
        self.positions[b:b + self.ring] = self.positions[a:a + self.ring]
        dev = self.rows.req_to_token.device
        return [("ring", torch.arange(b, b + self.ring, device=dev),
                 "ring", torch.arange(a, a + self.ring, device=dev))]

    # -- the prefix cache ----------------------------------------------------------------
    def prefix_parts(self) -> dict[str, Any] | None:
        if self.pages is None:
            return None  # a hit needs the window before it
        return {"has_sliding": True, "window_pool": self.pages}

    def cached(self, row: int, num_pages: int) -> dict[str, Any]:
        return {"window_pages": self.row_pages[row][:num_pages]}

    def restore(self, row: int, match: Match) -> list[Copy]:
        """Share the hit's window pages and copy the KV of the W positions before the hit
        point into the row's rings."""
        p = self.pages.page_size
        self.pages.allocator.incref([w for w in match.window_pages if w is not None])
        self.row_pages[row] = list(match.window_pages[:match.num_tokens // p])
        pos, src = restore_slots(match, self.window, p, self.positions.device)
        dst = row * self.ring + pos % self.ring
        self.positions[dst] = pos
        return [("ring", dst, "window_pages", src)]

    def only_cached(self) -> bool:
        if self.pages is None:
            return True
        held = self.prefix.references()[1] if self.prefix is not None else {}
        a = self.pages.allocator
        return a.num_pages - a.num_free == len(held)

    # -- copies, accounting, checks ------------------------------------------------------
    def slot_buffers(self, space: str) -> list[torch.Tensor] | None:
        if space == "ring":
            return self.buffers()
        return self.pages.buffers() if space == "window_pages" else None

    def usage(self) -> dict[str, tuple[int, int]]:
        per = self.nbytes() // max(1, self.rows.num_rows)
        free = self.rows.num_free
        out = {"ring": ((self.rows.num_rows - free) * per, free * per)}
        if self.pages is not None:
            a = self.pages.allocator
            per = self.pages.nbytes() // max(1, a.num_pages)
            out["window_pages"] = ((a.num_pages - a.num_free) * per, a.num_free * per)
        return out

    def check_integrity(self, used_rows: set[int]) -> None:
        if self.pages is None:
            return
        self.pages.allocator.check_integrity()
        held = self.prefix.references()[1] if self.prefix is not None else {}
        refs = Counter(held_pages(self.row_pages))
        for page, count in enumerate(self.pages.allocator.refcount):
            if count != refs.get(page, 0) + held.get(page, 0):
                raise AssertionError(f"window pages: page {page} has refcount {count}")
