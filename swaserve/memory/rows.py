"""Request rows (the req-to-token pool).

Address scheme: row `r`, token position `p` -> `req_to_token[r, p]`, the full-pool slot that
holds that token's full-layer KV. One owner (this class) hands rows out and takes them back.
Hooks registered with `register_on_alloc_rows` are called with rows that were *newly*
allocated, so per-row state (the window rings) is reset exactly once per request; a chunked
prefill that continues keeps its row and never triggers them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RequestRows:
    def __init__(self, num_rows: int, max_len: int, device: torch.device | str = "cpu"):
        self.num_rows = num_rows
        self.max_len = max_len
        self.req_to_token = torch.zeros(num_rows, max_len, dtype=torch.int64, device=device)
        self._free: list[int] = list(range(num_rows))
        self._used: set[int] = set()
        self._hooks: list[Callable[[list[int]], None]] = []

    def register_on_alloc_rows(self, hook: Callable[[list[int]], None]) -> None:
        self._hooks.append(hook)

    @property
    def used_rows(self) -> set[int]:
        """The rows in use (a copy)."""
        return set(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        rows = [self._free.pop() for _ in range(n)]
        self._used.update(rows)
        for hook in self._hooks:
            hook(rows)
        return rows

    def free(self, row: int) -> None:
        if row not in self._used:
            raise RuntimeError(f"row {row} freed twice or never allocated")
        self._used.remove(row)
        self._free.append(row)

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.num_rows or set(self._free) & self._used:
            raise AssertionError(
                f"request rows: free {len(self._free)} + used {len(self._used)} != {self.num_rows}")
