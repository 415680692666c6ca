"""PageAllocator: ref-counted pages of one pool (the full pool, the prefix cache's window
pages, the state pool's checkpoint slots). A page returns to the free list at refcount 0."""

from __future__ import annotations


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
