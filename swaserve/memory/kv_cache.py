"""KVCache: the one owner of request rows, the pools of per-request state a layout declares
(memory/pool_kinds.py: the full pool, the window pool with the prefix cache's window pages,
the state pool of recurrent layers, the compress pool) and the prefix cache. The scheduler
asks it for rows and pages; the model runner reads its pools' address schemes.

Every operation is a loop over the pools (memory/pool.py `Pool`): each pool answers for the
state it holds, and hands back the KV copies that other ranks replay (`copy_log`).
"""

from __future__ import annotations

import torch

from swaserve.memory.compress_pool import CompressPool
from swaserve.memory.full_pool import FullKVPool
from swaserve.memory.kv_quant import kv_format
from swaserve.memory.layout import CacheLayout
from swaserve.memory.plan import MemoryPlan
from swaserve.memory.pool import Copy, Pool, PoolEnv
from swaserve.memory.pool_kinds import declared_kinds
from swaserve.memory.prefix_cache import Match, PrefixCache, WindowPagePool
from swaserve.memory.rows import RequestRows
from swaserve.memory.state_pool import StatePool
from swaserve.memory.window_pool import WindowPool


class KVLost(RuntimeError):
    """A step failed in a way that left the KV data unusable (device="mlx": an `mx.eval`
    of the forward failed, and its lazy in-place KV writes cannot be rolled back). The
    engine fails every request holding KV, empties the prefix cache and goes on."""


class KVCache:
    def __init__(self, layout: CacheLayout, plan: MemoryPlan, max_model_len: int,
                 dtype: torch.dtype, device: torch.device | str, prefix_cache: bool = False,
                 kv_device: torch.device | str | None = None, kv_cache_dtype: str | None = None):
        """`kv_device`: where the K/V data lives, when not beside the index tables on
        `device`; "meta" when another array backend holds it (swaserve/mlx/cache.py): the
        pools then keep their shapes and byte counts, and `copy_log` their data moves.
        `kv_cache_dtype`: how every pool stores K/V (memory/kv_quant.py), for a plan made
        without a config; else the plan's format."""
        self.layout = layout
        self.dtype = dtype
        if kv_cache_dtype is None and plan.kv_format is not None:
            self.kv_format = plan.kv_format
        else:
            self.kv_format = kv_format(kv_cache_dtype or "auto", dtype)
        self.plan = plan
        self.page_size = plan.page_size
        self.device = device
        # the req-to-token table maps positions to full-pool slots: none without full layers
        self.rows = RequestRows(plan.num_rows, max_model_len if layout.paged else 1, device)
        env = PoolEnv(self.rows, dtype, self.kv_format, device, kv_device or device,
                      prefix_cache)
        self.pools: list[Pool] = [kind.create(layout, plan, env) for kind in declared_kinds(layout)]
        for pool in self.pools:
            self.rows.register_on_alloc_rows(pool.reset_rows)
        # the pools by kind, for the code that reads a kind's address scheme (None: not
        # declared); the kinds of today also as typed attributes
        self.by_kind: dict[str, Pool] = {pool.kind: pool for pool in self.pools}
        self.full: FullKVPool | None = self.pool("full")
        self.window: WindowPool | None = self.pool("window")
        self.state: StatePool | None = self.pool("state")
        self.compress: CompressPool | None = self.pool("compress")
        self.prefix: PrefixCache | None = None
        parts = [pool.prefix_parts() for pool in self.pools]
        if prefix_cache and all(part is not None for part in parts):
            self.prefix = PrefixCache(plan.page_size, layout.max_window,
                                      **{k: v for part in parts for k, v in part.items()})
            for pool in self.pools:
                pool.prefix = self.prefix
        # tokens between two state checkpoints (StatePool.checkpoint_positions; the engine
        # sets it)
        self.checkpoint_interval = 0
        # tensor parallelism: the KV copies made outside a forward (forks, prefix hits), in
        # order, for the other ranks to replay on their shards before the next forward
        self.copy_log: list[Copy] | None = None

    def pool(self, kind: str) -> Pool | None:
        """The pool of `kind` (`Pool.kind`), None where the layout declares none."""
        return self.by_kind.get(kind)

    @property
    def window_pages(self) -> WindowPagePool | None:
        """The prefix cache's window pages (the window pool's)."""
        return self.window.pages if self.window is not None else None

    @property
    def row_pages(self) -> dict[int, list[int]]:
        """Each row's full-pool pages, in position order."""
        return self.full.row_pages if self.full is not None else {}

    @property
    def row_window_pages(self) -> dict[int, list[int | None]]:
        """Each row's window pages (None where the pool had none to give)."""
        return self.window.row_pages if self.window is not None else {}

    def _copies(self, copies: list[Copy]) -> None:
        for copy in copies:
            self.copy_kv(*copy)

    # -- rows ----------------------------------------------------------------------------
    def alloc_row(self) -> int | None:
        got = self.rows.alloc(1)  # the pools' alloc hooks open the row
        return got[0] if got is not None else None

    def free_row(self, row: int) -> None:
        for pool in self.pools:
            pool.free_row(row)
        self.rows.free(row)

    # -- pages ---------------------------------------------------------------------------
    def pages_needed(self, row: int | None, num_tokens: int) -> int:
        """Pages a row must add so that positions [0, num_tokens) have full-pool slots."""
        return sum(pool.pages_needed(row, num_tokens) for pool in self.pools)

    @property
    def num_free_pages(self) -> int:
        return sum(pool.free_pages()[0] for pool in self.pools)

    @property
    def num_total_pages(self) -> int:
        return sum(pool.free_pages()[1] for pool in self.pools)

    def can_fit(self, pages: int) -> bool:
        """`pages` full-pool pages are free, evicting unused cached prefixes if need be."""
        if pages <= self.num_free_pages:
            return True
        if self.prefix is not None:
            self.prefix.evict(full_pages=pages)
        return pages <= self.num_free_pages

    def ensure_slots(self, row: int, num_tokens: int) -> bool:
        """Give `row` full-pool slots (and, with the prefix cache, window pages to write
        through to) for positions [0, num_tokens). False if full pages ran out."""
        return all(pool.ensure(row, num_tokens) for pool in self.pools)

    def fits_free(self, row: int, num_tokens: int) -> bool:
        """Positions [0, num_tokens) of `row` fit the full and window pages free now, with no
        cached prefix evicted (what a speculative draft may take)."""
        return all(pool.fits_free(row, num_tokens) for pool in self.pools)

    def discard(self, row: int, start: int, end: int) -> None:
        """Forget positions [start, end) of a row (a draft's rejected tokens): its ring slots
        hold no position any more, and the full and window pages past those that positions
        [0, start + 1) use go back to their pools. Whatever these positions wrote is
        rewritten before it is read: masks come from positions, and a row computes a
        position before attending to it. A recurrent state is not rewritten: it takes the
        snapshot of the drafted step after position start - 1 (StatePool.select_draft)."""
        for pool in self.pools:
            self._copies(pool.discard(row, start, end))

    # -- sharing -------------------------------------------------------------------------
    def fork_row(self, src: int, num_tokens: int) -> int | None:
        """A new row holding the same first `num_tokens` tokens as `src`: whole full-pool
        pages are shared (ref-counted), the partly filled last page is copied (both rows
        write after it), and the rings and states are copied. None when no row or page is
        free."""
        row = self.alloc_row()
        if row is None:
            return None
        copies: list[Copy] = []
        for pool in self.pools:
            try:
                got = pool.fork(src, row, num_tokens)
            except Exception:
                self.free_row(row)
                raise
            if got is None:
                self.free_row(row)
                return None
            copies += got
        self._copies(copies)
        return row

    def match_prefix(self, tokens: list[int]) -> Match | None:
        if self.prefix is None:
            return None
        self.prefix.query_tokens += len(tokens)
        m = self.prefix.match(tokens)
        return m if m.num_tokens else None

    def restore(self, row: int, m: Match) -> None:
        """Start `row` from a cache hit: share the hit's full pages and window pages, and copy
        the sliding KV of the W positions before the hit point into the row's ring (and a
        recurrent state's checkpoint into its slot)."""
        for pool in self.pools:
            self._copies(pool.restore(row, m))
        self.prefix.hit_tokens += m.num_tokens

    def cache_tokens(self, row: int, tokens: list[int]):
        """Insert the whole pages of `tokens` (all computed by `row`) into the prefix tree,
        with the state checkpoints the row took within them."""
        n = len(tokens) // self.page_size
        parts = {"full_pages": [], "window_pages": []}
        for pool in self.pools:
            parts.update(pool.cached(row, n))
        return self.prefix.insert(tokens[:n * self.page_size], **parts)

    # -- copies --------------------------------------------------------------------------
    def copy_kv(self, dst_pool: str, dst: torch.Tensor, src_pool: str, src: torch.Tensor,
                log: bool = True) -> None:
        """KV at slots `src` of one slot space ("full", "ring", "window_pages", "state") into
        slots `dst` of another, in every layer of their kind, values and scales alike (and
        what a pool keeps beside them: compressed entries beside full pages), logged when
        copy_log is on."""
        for d, s in zip(self._kv_buffers(dst_pool), self._kv_buffers(src_pool)):
            d[dst] = s[src]
        for pool in self.pools:
            pool.copied(dst_pool, dst, src_pool, src)
        if log and self.copy_log is not None:
            self.copy_log.append((dst_pool, dst, src_pool, src))

    def replay_copies(self, copies: list[Copy]) -> None:
        """Another rank's copy_log, on this rank's shard of the same pools."""
        for dst_pool, dst, src_pool, src in copies:
            self.copy_kv(dst_pool, dst, src_pool, src, log=False)

    def take_copies(self) -> list[Copy]:
        """The copies logged since the last call (the log starts over)."""
        out = self.copy_log or []
        if self.copy_log is not None:
            self.copy_log = []
        return out

    def _kv_buffers(self, space: str) -> list[torch.Tensor]:
        for pool in self.pools:
            buffers = pool.slot_buffers(space)
            if buffers is not None:
                return buffers
        raise KeyError(f"no pool holds slot space {space!r}")

    # -- accounting ----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of every pool tensor this cache allocated (the planner's `used_bytes`)."""
        return sum(pool.pool_bytes() for pool in self.pools)

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, free) bytes of each pool: "full" (pages), "ring" (request rows' rings),
        "window_pages" (the prefix cache's sliding-layer pages), "state" (request rows'
        recurrent state) and "state_checkpoints" (the prefix cache's)."""
        out: dict[str, tuple[int, int]] = {}
        for pool in self.pools:
            out.update(pool.usage())
        return out

    def is_fully_free(self) -> bool:
        """No row is in use and every page still allocated belongs to the prefix cache only
        (`evict_all` then returns the pools to fully free)."""
        if self.rows.num_free != self.rows.num_rows:
            return False
        return all(pool.only_cached() for pool in self.pools)

    def evict_all(self) -> None:
        if self.prefix is not None:
            self.prefix.evict_all()

    def check_integrity(self) -> None:
        self.rows.check_integrity()
        used = self.rows.used_rows
        for pool in self.pools:
            pool.check_integrity(used)
