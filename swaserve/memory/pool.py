"""The Pool protocol: one kind of per-request state behind one interface.

A kind of state (full-attention pages, window rings and their prefix pages, recurrent
state, compress state) is one pool class. The planner sums the costs of the pools a layout
declares (`Pool.costs`), and KVCache runs every operation over the pools it built: rows
taken and freed, pages for new positions, rejected draft positions, forks, prefix-cache
hits and insertions, usage, integrity and bytes. A pool answers only for what it holds, so
a new kind is a new class in POOL_KINDS (memory/pool_kinds.py), not an edit of each operation.

Copies of KV slots that other tensor-parallel ranks (or another array backend) must replay
are returned as `Copy` tuples; KVCache makes and logs them (`KVCache.copy_kv`). What only
rank 0 keeps (positions, page tables) a pool changes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from swaserve.memory.kv_quant import KVFormat
    from swaserve.memory.layout import CacheLayout
    from swaserve.memory.plan import MemoryPlan
    from swaserve.memory.prefix_cache import Match, PrefixCache
    from swaserve.memory.rows import RequestRows

# (destination space, slots, source space, slots): a copy of KV slots between the named
# slot spaces ("full", "ring", "window_pages", "state") in every layer of their kind
Copy = tuple[str, torch.Tensor, str, torch.Tensor]


@dataclass(frozen=True)
class Sizing:
    """What a pool's costs depend on beside the layout: bytes of a stored value and of a
    quantized KV head's scales, a ring's slots and the longest context (the req-to-token
    row)."""

    dtype_bytes: int
    scale_bytes: int = 0
    ring: int = 0
    max_model_len: int = 0


@dataclass(frozen=True)
class Costs:
    """What a pool charges the planner: per full-pool token (what grows with a request's
    context), per request row (prepaid when the row is taken), per token of the prefix
    cache's window pages, and per state slot beside the rows (draft snapshots and prefix
    checkpoints)."""

    token: int = 0
    row: int = 0
    cached_token: int = 0
    slot: int = 0

    def __add__(self, other: Costs) -> Costs:
        return Costs(self.token + other.token, self.row + other.row,
                     self.cached_token + other.cached_token, self.slot + other.slot)


@dataclass(frozen=True)
class PoolEnv:
    """What every pool is built from beside the layout and the plan."""

    rows: RequestRows
    dtype: torch.dtype
    kv_format: KVFormat
    device: torch.device | str  # index tables and positions
    kv_device: torch.device | str  # the K/V data ("meta" when another backend holds it)
    prefix_cache: bool


class Pool:
    """One kind of per-request state. Every method but `declared`, `costs`, `create` and
    `pool_bytes` has a default that does nothing, for a pool that holds nothing of that
    concern."""

    # the name KVCache keeps the pool under (`KVCache.full`, `.window`, `.state`, ...)
    kind: ClassVar[str]
    prefix: PrefixCache | None = None  # the prefix tree, once KVCache has built it

    # -- the plan ------------------------------------------------------------------------
    @classmethod
    def declared(cls, layout: CacheLayout) -> bool:
        """Whether a model of `layout` needs this pool."""
        raise NotImplementedError

    @classmethod
    def costs(cls, layout: CacheLayout, sizing: Sizing) -> Costs:
        """The bytes this pool allocates, per unit the planner sizes."""
        raise NotImplementedError

    @classmethod
    def create(cls, layout: CacheLayout, plan: MemoryPlan, env: PoolEnv) -> Pool:
        """The pool for `plan` (called only where `declared`)."""
        raise NotImplementedError

    def pool_bytes(self) -> int:
        """Bytes of every tensor this pool allocated, as `costs` charges them."""
        raise NotImplementedError

    # -- rows and pages ------------------------------------------------------------------
    def reset_rows(self, rows: list[int]) -> None:
        """Rows newly allocated (never a chunked continuation's): their state starts empty."""

    def free_row(self, row: int) -> None:
        """`row` is given back: release what it holds."""

    def pages_needed(self, row: int | None, num_tokens: int) -> int:
        """Pages admission must find for positions [0, num_tokens) (the full pool's)."""
        return 0

    def free_pages(self) -> tuple[int, int]:
        """(free, total) pages that admission counts."""
        return 0, 0

    def ensure(self, row: int, num_tokens: int) -> bool:
        """Room for positions [0, num_tokens) of `row`; False where pages ran out."""
        return True

    def fits_free(self, row: int, num_tokens: int) -> bool:
        """Positions [0, num_tokens) of `row` fit what is free now, evicting nothing."""
        return True

    def discard(self, row: int, start: int, end: int) -> list[Copy]:
        """Forget positions [start, end) of `row` (a draft's rejected tokens)."""
        return []

    def fork(self, src: int, dst: int, num_tokens: int) -> list[Copy] | None:
        """Row `dst` (just allocated) continues the first `num_tokens` of `src`; None when
        a page ran out (the caller frees `dst`)."""
        return []

    # -- the prefix cache ----------------------------------------------------------------
    def prefix_parts(self) -> dict[str, Any] | None:
        """What the prefix tree takes of this pool (PrefixCache's arguments), or None when
        this pool cannot serve exact hits (no budget for its part)."""
        return {}

    def cached(self, row: int, num_pages: int) -> dict[str, Any]:
        """What the row holds of its first `num_pages` pages (PrefixCache.insert's
        arguments)."""
        return {}

    def restore(self, row: int, match: Match) -> list[Copy]:
        """Start `row` from a prefix hit."""
        return []

    def only_cached(self) -> bool:
        """With no row in use: all this pool still holds belongs to the prefix tree."""
        return True

    # -- copies, accounting, checks ------------------------------------------------------
    def slot_buffers(self, space: str) -> list[torch.Tensor] | None:
        """The buffers indexed by slots of the slot space `space`, or None when it is not
        this pool's."""
        return None

    def copied(self, dst_space: str, dst: torch.Tensor, src_space: str,
               src: torch.Tensor) -> None:
        """Slots of another pool's space were copied: copy what this pool keeps beside
        them (compressed entries beside full-pool pages)."""

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, free) bytes of each of this pool's parts."""
        return {}

    def check_integrity(self, used_rows: set[int]) -> None:
        """Raise AssertionError where the pool's bookkeeping does not hold."""


def held_pages(pages: dict[int, list[int]] | dict[int, list[int | None]]) -> list[int]:
    """Every page the rows of `pages` hold, once per holder."""
    return [p for ps in pages.values() for p in ps if p is not None]
