"""The paged full-attention KV pool, shared by all requests.

Address scheme: slot `s = page * page_size + offset`; one K and one V buffer of
`[num_pages * page_size, kv_heads, head_dim]` per full layer (and their scales when the KV
is quantized: memory/kv_quant.py), indexed by the layer's dense full index
(CacheLayout.dense_index). Pages are ref-counted so that several requests (and
later the prefix cache) can share them; a page returns to the free list at refcount 0.
"""

from __future__ import annotations

import torch

from swaserve.memory.kv_quant import KVBuffers, KVFormat
from swaserve.memory.layout import CacheLayout


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} shared while free")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released while free")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def check_integrity(self) -> None:
        used = sum(1 for c in self.refcount if c > 0)
        if used + len(self._free) != self.num_pages or len(set(self._free)) != len(self._free):
            raise AssertionError(
                f"full pool: free {len(self._free)} + used {used} != {self.num_pages} pages")
        if any(self.refcount[p] != 0 for p in self._free):
            raise AssertionError("full pool: a free page has a nonzero refcount")


class FullKVPool(KVBuffers):
    def __init__(self, layout: CacheLayout, num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device | str):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        num_slots = num_pages * page_size
        super().__init__([(num_slots, layout.layers[i].num_kv_heads, layout.layers[i].head_dim)
                          for i in layout.full_layers], fmt, device)

    @property
    def num_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
