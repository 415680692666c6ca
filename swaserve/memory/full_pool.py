"""The paged full-attention KV pool, shared by all requests.

Address scheme: slot `s = page * page_size + offset`; one K and one V buffer of
`[num_pages * page_size, kv_heads, head_dim]` per full layer, indexed by the layer's dense
full index (CacheLayout.dense_index). Pages are ref-counted so that several requests (and
later the prefix cache) can share them; a page returns to the free list at refcount 0.
"""

from __future__ import annotations

import torch

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


class FullKVPool:
    def __init__(self, layout: CacheLayout, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        num_slots = num_pages * page_size
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i in layout.full_layers:
            spec = layout.layers[i]
            shape = (num_slots, spec.num_kv_heads, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, dense_layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[dense_layer].index_copy_(0, slots, k)
        self.v[dense_layer].index_copy_(0, slots, v)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
