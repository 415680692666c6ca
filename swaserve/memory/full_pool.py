"""The paged full-attention KV pool, shared by all requests.

Address scheme: slot `s = page * page_size + offset`; one K and one V buffer of
`[num_pages * page_size, kv_heads, head_dim]` per full layer (and their scales when the KV
is quantized: memory/kv_quant.py), indexed by the layer's dense full index
(CacheLayout.dense_index). Pages are ref-counted so that several requests (and
later the prefix cache) can share them; a page returns to the free list at refcount 0.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from swaserve.memory.kv_quant import KVBuffers, KVFormat
from swaserve.memory.layout import CacheLayout
from swaserve.memory.pages import PageAllocator
from swaserve.memory.pool import Copy, Costs, Pool, PoolEnv, Sizing, held_pages
from swaserve.memory.rows import RequestRows

if TYPE_CHECKING:
    from swaserve.memory.plan import MemoryPlan
    from swaserve.memory.prefix_cache import Match


class FullKVPool(KVBuffers, Pool):
    """The full pool, and per request row the pages it writes (`row_pages`, in position
    order) and their slots in the rows' req-to-token table."""

    kind = "full"

    def __init__(self, layout: CacheLayout, num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device | str, rows: RequestRows | None = None):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.rows = rows
        self.row_pages: dict[int, list[int]] = {}
        num_slots = num_pages * page_size
        super().__init__([(num_slots, layout.layers[i].num_kv_heads, layout.layers[i].head_dim)
                          for i in layout.full_layers], fmt, device)

    @classmethod
    def declared(cls, layout: CacheLayout) -> bool:
        return layout.paged  # full layers' KV, or only compressed entries (DeepSeek-V4)

    @classmethod
    def costs(cls, layout: CacheLayout, sizing: Sizing) -> Costs:
        """Each stored full layer's K/V a token; a row's req-to-token row (int64 slots)."""
        per_token = sum(layout.layers[i].kv_bytes_per_token(sizing.dtype_bytes, sizing.scale_bytes)
                        for i in layout.full_layers)
        return Costs(token=per_token, row=8 * sizing.max_model_len if layout.paged else 0)

    @classmethod
    def create(cls, layout: CacheLayout, plan: MemoryPlan, env: PoolEnv) -> FullKVPool:
        return cls(layout, plan.full_pool_pages, plan.page_size, env.kv_format, env.kv_device,
                   env.rows)

    @property
    def num_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def pool_bytes(self) -> int:
        return self.nbytes() + self.rows.req_to_token.numel() * 8

    # -- rows and pages ------------------------------------------------------------------
    def reset_rows(self, rows: list[int]) -> None:
        for r in rows:
            self.row_pages[r] = []

    def free_row(self, row: int) -> None:
        self.allocator.decref(self.row_pages.pop(row))

    def pages_needed(self, row: int | None, num_tokens: int) -> int:
        have = len(self.row_pages[row]) if row is not None else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    def free_pages(self) -> tuple[int, int]:
        return self.allocator.num_free, self.allocator.num_pages

    def set_slots(self, row: int, start_page: int, pages: list[int]) -> None:
        """The req-to-token entries of `pages`, the row's pages from `start_page` on."""
        p = self.page_size
        t = torch.tensor(pages, dtype=torch.int64)
        slots = (t[:, None] * p + torch.arange(p)).flatten()
        start = start_page * p
        end = min(start + slots.numel(), self.rows.max_len)
        r2t = self.rows.req_to_token
        r2t[row, start:end] = slots[: end - start].to(r2t.device)

    def ensure(self, row: int, num_tokens: int) -> bool:
        need = self.pages_needed(row, num_tokens)
        if need:
            new = self.allocator.alloc(need)
            if new is None:
                return False
            self.set_slots(row, len(self.row_pages[row]), new)
            self.row_pages[row].extend(new)
        return True

    def fits_free(self, row: int, num_tokens: int) -> bool:
        return self.pages_needed(row, num_tokens) <= self.allocator.num_free

    def discard(self, row: int, start: int, end: int) -> list[Copy]:
        keep = -(-(start + 1) // self.page_size)
        pages = self.row_pages[row]
        if end > start and len(pages) > keep:
            self.allocator.decref(pages[keep:])
            del pages[keep:]
        return []

    def fork(self, src: int, dst: int, num_tokens: int) -> list[Copy] | None:
        """Whole pages are shared (ref-counted); the partly filled last one is copied, as
        both rows write after it."""
        p = self.page_size
        whole, partial = divmod(num_tokens, p)
        shared = self.row_pages[src][:whole]
        pages = list(shared)
        copies: list[Copy] = []
        if partial:
            new = self.allocator.alloc(1)
            if new is None:
                return None
            old = self.row_pages[src][whole]
            dev = self.rows.req_to_token.device
            copies.append(("full", torch.arange(new[0] * p, new[0] * p + partial, device=dev),
                           "full", torch.arange(old * p, old * p + partial, device=dev)))
            pages += new
        self.allocator.incref(shared)
        self.row_pages[dst] = pages
        r2t = self.rows.req_to_token
        r2t[dst, :whole * p] = r2t[src, :whole * p]
        if partial:
            self.set_slots(dst, whole, pages[-1:])
        return copies

    # -- the prefix cache ----------------------------------------------------------------
    def prefix_parts(self) -> dict[str, Any]:
        return {"has_full": True, "full_alloc": self.allocator}

    def cached(self, row: int, num_pages: int) -> dict[str, Any]:
        return {"full_pages": self.row_pages[row][:num_pages]}

    def restore(self, row: int, match: Match) -> list[Copy]:
        self.allocator.incref(match.full_pages)
        self.row_pages[row] = list(match.full_pages)
        self.set_slots(row, 0, match.full_pages)
        return []

    def only_cached(self) -> bool:
        held = self.prefix.references()[0] if self.prefix is not None else {}
        return self.allocator.num_pages - self.allocator.num_free == len(held)

    # -- copies, accounting, checks ------------------------------------------------------
    def slot_buffers(self, space: str) -> list[torch.Tensor] | None:
        return self.buffers() if space == "full" else None

    def usage(self) -> dict[str, tuple[int, int]]:
        a = self.allocator
        per = self.nbytes() // max(1, a.num_pages)
        return {"full": ((a.num_pages - a.num_free) * per, a.num_free * per)}

    def check_integrity(self, used_rows: set[int] | None = None) -> None:
        self.allocator.check_integrity()
        if self.rows is None:
            return
        held = self.prefix.references()[0] if self.prefix is not None else {}
        refs = Counter(held_pages(self.row_pages))
        for page, count in enumerate(self.allocator.refcount):
            if count != refs.get(page, 0) + held.get(page, 0):
                raise AssertionError(f"full pool: page {page} has refcount {count} but "
                                     f"{refs.get(page, 0)} row and {held.get(page, 0)} "
                                     "cache references")
