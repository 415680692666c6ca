"""KVCache: the one owner of request rows, the full pool and the window pool.

The scheduler asks it for rows and pages; the model runner reads its address schemes.
"""

from __future__ import annotations

from collections import Counter

import torch

from swaserve.memory.full_pool import FullKVPool
from swaserve.memory.layout import CacheLayout
from swaserve.memory.planner import MemoryPlan
from swaserve.memory.rows import RequestRows
from swaserve.memory.window_pool import WindowPool


class KVCache:
    def __init__(self, layout: CacheLayout, plan: MemoryPlan, max_model_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.layout = layout
        self.plan = plan
        self.page_size = plan.page_size
        # the req-to-token table maps positions to full-pool slots: none without full layers
        self.rows = RequestRows(plan.num_rows, max_model_len if layout.full_layers else 1, device)
        self.full: FullKVPool | None = None
        self.window: WindowPool | None = None
        if layout.full_layers:
            self.full = FullKVPool(layout, plan.full_pool_pages, plan.page_size, dtype, device)
        if layout.sliding_layers:
            self.window = WindowPool(layout, plan.num_rows, plan.ring, dtype, device)
            self.rows.register_on_alloc_rows(self.window.reset_rows)
        # page lists per row, in position order
        self.row_pages: dict[int, list[int]] = {}
        # references held outside the rows (the prefix cache), page -> count
        self.external_refs: Counter[int] = Counter()

    # -- rows ----------------------------------------------------------------------------
    def alloc_row(self) -> int | None:
        got = self.rows.alloc(1)
        if got is None:
            return None
        self.row_pages[got[0]] = []
        return got[0]

    def free_row(self, row: int) -> None:
        pages = self.row_pages.pop(row)
        if self.full is not None:
            self.full.allocator.decref(pages)
        self.rows.free(row)

    # -- full-pool pages -----------------------------------------------------------------
    def pages_needed(self, row: int | None, num_tokens: int) -> int:
        """Pages a row must add so that positions [0, num_tokens) have full-pool slots."""
        if self.full is None:
            return 0
        have = len(self.row_pages[row]) if row is not None else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    @property
    def num_free_pages(self) -> int:
        return self.full.allocator.num_free if self.full is not None else 0

    @property
    def num_total_pages(self) -> int:
        return self.full.allocator.num_pages if self.full is not None else 0

    def can_fit(self, pages: int) -> bool:
        return pages <= self.num_free_pages

    def ensure_slots(self, row: int, num_tokens: int) -> bool:
        """Give `row` full-pool slots for positions [0, num_tokens). False if pages ran out."""
        if self.full is None:
            return True
        need = self.pages_needed(row, num_tokens)
        if need == 0:
            return True
        new = self.full.allocator.alloc(need)
        if new is None:
            return False
        pages = self.row_pages[row]
        start = len(pages) * self.page_size
        pages.extend(new)
        p = torch.tensor(new, dtype=torch.int64)
        slots = (p[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        end = min(start + slots.numel(), self.rows.max_len)
        self.rows.req_to_token[row, start:end] = slots[: end - start].to(self.rows.req_to_token.device)
        return True

    def fork_row(self, src: int, num_tokens: int) -> int | None:
        """A new row holding the same first `num_tokens` tokens as `src`: whole full-pool
        pages are shared (ref-counted), the partly filled last page is copied (both rows
        write after it), and the rings are copied. None when no row or page is free."""
        row = self.alloc_row()
        if row is None:
            return None
        if self.full is not None:
            p = self.page_size
            whole, partial = divmod(num_tokens, p)
            shared = self.row_pages[src][:whole]
            pages = list(shared)
            if partial:
                new = self.full.allocator.alloc(1)
                if new is None:
                    self.free_row(row)
                    return None
                old = self.row_pages[src][whole]
                for buf in self.full.k + self.full.v:
                    buf[new[0] * p:new[0] * p + partial] = buf[old * p:old * p + partial]
                pages += new
            self.full.allocator.incref(shared)
            self.row_pages[row] = pages
            r2t = self.rows.req_to_token
            r2t[row, :whole * p] = r2t[src, :whole * p]
            if partial:
                r2t[row, whole * p:(whole + 1) * p] = pages[-1] * p + torch.arange(p, device=r2t.device)
        if self.window is not None:
            self.window.copy_row(src, row)
        return row

    # -- accounting ----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of every pool tensor this cache allocated (the planner's `used_bytes`)."""
        total = self.rows.req_to_token.numel() * 8 if self.full is not None else 0
        if self.full is not None:
            total += self.full.nbytes()
        if self.window is not None:
            total += self.window.nbytes() + self.window.positions.numel() * 8
        return total

    def is_fully_free(self) -> bool:
        full_free = self.full is None or self.full.allocator.num_free == self.full.allocator.num_pages
        return full_free and self.rows.num_free == self.rows.num_rows

    def check_integrity(self) -> None:
        self.rows.check_integrity()
        if self.full is not None:
            self.full.check_integrity()
            refs = Counter(p for pages in self.row_pages.values() for p in pages)
            for page, count in enumerate(self.full.allocator.refcount):
                if count != refs.get(page, 0) + self.external_refs.get(page, 0):
                    raise AssertionError(
                        f"full pool: page {page} has refcount {count} but {refs.get(page, 0)} "
                        f"row references")
