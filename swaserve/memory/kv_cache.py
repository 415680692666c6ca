"""KVCache: the one owner of request rows, the full pool, the window pool, the state pool
(recurrent layers' per-row state, draft snapshots and prefix checkpoints) and the prefix
cache (with its window pages). The scheduler asks it for rows and pages; the model runner
reads its address schemes.

Per row it keeps, in position order, the full-pool pages (`row_pages`) and the window
pages (`row_window_pages`, None where the pool had none to give) that the row writes
through to; both are ref-counted, so rows and the prefix tree share them freely.
"""

from __future__ import annotations

from collections import Counter

import torch

from swaserve.memory.compress_pool import CompressPool
from swaserve.memory.full_pool import FullKVPool
from swaserve.memory.kv_quant import kv_format
from swaserve.memory.layout import CacheLayout
from swaserve.memory.planner import MemoryPlan
from swaserve.memory.prefix_cache import Match, PrefixCache, WindowPagePool
from swaserve.memory.rows import RequestRows
from swaserve.memory.state_pool import StatePool
from swaserve.memory.window_pool import EMPTY, WindowPool


class KVLost(RuntimeError):
    """A step failed in a way that left the KV data unusable (device="mlx": an `mx.eval`
    of the forward failed, and its lazy in-place KV writes cannot be rolled back). The
    engine fails every request holding KV, empties the prefix cache and goes on."""


class KVCache:
    def __init__(self, layout: CacheLayout, plan: MemoryPlan, max_model_len: int,
                 dtype: torch.dtype, device: torch.device | str, prefix_cache: bool = False,
                 kv_device: torch.device | str | None = None, kv_cache_dtype: str = "auto"):
        """`kv_device`: where the K/V data lives, when not beside the index tables on
        `device`; "meta" when another array backend holds it (swaserve/mlx/cache.py): the
        pools then keep their shapes and byte counts, and `copy_log` their data moves.
        `kv_cache_dtype`: how every pool stores K/V (memory/kv_quant.py)."""
        kv_device = kv_device or device
        self.layout = layout
        self.dtype = dtype
        self.kv_format = kv_format(kv_cache_dtype, dtype)
        self.plan = plan
        self.page_size = plan.page_size
        self.device = device
        # the req-to-token table maps positions to full-pool slots: none without full layers
        self.rows = RequestRows(plan.num_rows, max_model_len if layout.paged else 1, device)
        self.full: FullKVPool | None = None
        self.window: WindowPool | None = None
        if layout.paged:  # full layers' KV, or only compressed entries (DeepSeek-V4)
            self.full = FullKVPool(layout, plan.full_pool_pages, plan.page_size, self.kv_format,
                                   kv_device)
        if layout.sliding_layers:
            self.window = WindowPool(layout, plan.num_rows, plan.ring, self.kv_format, device,
                                     kv_device)
            self.rows.register_on_alloc_rows(self.window.reset_rows)
        self.state: StatePool | None = None
        if layout.recurrent_layers:
            self.state = StatePool(layout, plan.num_rows, plan.draft_state_slots,
                                   plan.state_checkpoint_slots, dtype, device, kv_device)
            self.rows.register_on_alloc_rows(self.state.reset_rows)
        self.compress: CompressPool | None = None  # DeepSeek-V4's compressed layers
        if layout.compressed_layers:
            self.compress = CompressPool(layout, plan.num_rows, self.full.num_tokens,
                                         plan.page_size, dtype, kv_device)
            self.rows.register_on_alloc_rows(self.compress.reset_rows)
        self.window_pages: WindowPagePool | None = None
        self.prefix: PrefixCache | None = None
        if prefix_cache:
            if layout.sliding_layers and plan.window_cache_pages:
                self.window_pages = WindowPagePool(layout, plan.window_cache_pages, plan.page_size,
                                                   self.kv_format, kv_device)
                if self.compress is not None:  # cached tokens' compress state beside them
                    longest = max(layout.layers[i].compress.needed
                                  for i in layout.compressed_layers)
                    if longest > layout.max_window:  # a hit restores W positions
                        raise ValueError(f"prefix_cache: a compressed layer needs {longest} "
                                         "raw tokens at a hit, more than the window "
                                         f"{layout.max_window} the hit restores; turn it off")
                    self.compress.add_pages(plan.window_cache_pages * plan.page_size)
            windows_ok = not layout.sliding_layers or self.window_pages is not None
            states_ok = self.state is None or plan.state_checkpoint_slots > 0
            if windows_ok and states_ok:
                self.prefix = PrefixCache(
                    plan.page_size, layout.max_window, self.full is not None,
                    bool(layout.sliding_layers),
                    self.full.allocator if self.full is not None else None, self.window_pages,
                    self.state.checkpoints if self.state is not None else None)
        self.row_pages: dict[int, list[int]] = {}
        self.row_window_pages: dict[int, list[int | None]] = {}
        # recurrent-state checkpoints a row took and holds until it is freed: position ->
        # checkpoint; the prefix tree takes its own reference when the row caches them
        self.row_checkpoints: dict[int, dict[int, int]] = {}
        self.checkpoint_interval = 0  # tokens between two checkpoints (set by the engine)
        # tensor parallelism: the KV copies made outside a forward (forks, prefix hits), in
        # order, for the other ranks to replay on their shards before the next forward
        self.copy_log: list[tuple[str, torch.Tensor, str, torch.Tensor]] | None = None

    # -- rows ----------------------------------------------------------------------------
    def alloc_row(self) -> int | None:
        got = self.rows.alloc(1)
        if got is None:
            return None
        self.row_pages[got[0]] = []
        self.row_window_pages[got[0]] = []
        self.row_checkpoints[got[0]] = {}
        return got[0]

    def free_row(self, row: int) -> None:
        pages = self.row_pages.pop(row)
        if self.full is not None:
            self.full.allocator.decref(pages)
        wpages = [w for w in self.row_window_pages.pop(row) if w is not None]
        if wpages:
            self.window_pages.allocator.decref(wpages)
        if self.state is not None:
            self.state.drafts.pop(row, None)
        held = list(self.row_checkpoints.pop(row).values())
        if held:
            self.state.checkpoints.decref(held)
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
        """`pages` full-pool pages are free, evicting unused cached prefixes if need be."""
        if pages <= self.num_free_pages:
            return True
        if self.prefix is not None:
            self.prefix.evict(full_pages=pages)
        return pages <= self.num_free_pages

    def _set_slots(self, row: int, start_page: int, pages: list[int]) -> None:
        p = self.page_size
        t = torch.tensor(pages, dtype=torch.int64)
        slots = (t[:, None] * p + torch.arange(p)).flatten()
        start = start_page * p
        end = min(start + slots.numel(), self.rows.max_len)
        self.rows.req_to_token[row, start:end] = slots[: end - start].to(self.rows.req_to_token.device)

    def ensure_slots(self, row: int, num_tokens: int) -> bool:
        """Give `row` full-pool slots (and, with the prefix cache, window pages to write
        through to) for positions [0, num_tokens). False if full pages ran out."""
        if self.full is not None:
            need = self.pages_needed(row, num_tokens)
            if need:
                new = self.full.allocator.alloc(need)
                if new is None:
                    return False
                self._set_slots(row, len(self.row_pages[row]), new)
                self.row_pages[row].extend(new)
        if self.window_pages is not None:
            wp = self.row_window_pages[row]
            need = -(-num_tokens // self.page_size) - len(wp)
            if need > 0:
                alloc = self.window_pages.allocator
                if alloc.num_free < need:
                    self.prefix.evict(window_pages=need)
                got = alloc.alloc(min(need, alloc.num_free)) or []
                wp.extend(got + [None] * (need - len(got)))
        return True

    def fits_free(self, row: int, num_tokens: int) -> bool:
        """Positions [0, num_tokens) of `row` fit the full and window pages free now, with no
        cached prefix evicted (what a speculative draft may take)."""
        if self.pages_needed(row, num_tokens) > self.num_free_pages:
            return False
        if self.window_pages is None:
            return True
        need = -(-num_tokens // self.page_size) - len(self.row_window_pages[row])
        return need <= self.window_pages.allocator.num_free

    def discard(self, row: int, start: int, end: int) -> None:
        """Forget positions [start, end) of a row (a draft's rejected tokens): its ring slots
        hold no position any more, and the full and window pages past those that positions
        [0, start + 1) use go back to their pools. Whatever these positions wrote is
        rewritten before it is read: masks come from positions, and a row computes a
        position before attending to it. A recurrent state is not rewritten: it takes the
        snapshot of the drafted step after position start - 1 (StatePool.select_draft)."""
        if self.state is not None and row in self.state.drafts:
            for dst, src in self.state.select_draft(row, start):
                self.copy_kv("state", torch.tensor([dst], device=self.device),
                             "state", torch.tensor([src], device=self.device))
        if end <= start:
            return
        if self.window is not None:
            ring = self.window.ring
            slots = row * ring + torch.arange(start, end) % ring
            self.window.positions[slots.to(self.window.positions.device)] = EMPTY
        if self.compress is not None:
            self.compress.forget(row, start, end)
        keep = -(-(start + 1) // self.page_size)
        if self.full is not None and len(self.row_pages[row]) > keep:
            self.full.allocator.decref(self.row_pages[row][keep:])
            del self.row_pages[row][keep:]
        if self.window_pages is not None and len(self.row_window_pages[row]) > keep:
            extra = [w for w in self.row_window_pages[row][keep:] if w is not None]
            if extra:
                self.window_pages.allocator.decref(extra)
            del self.row_window_pages[row][keep:]

    def window_write_slots(self, row: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """(offsets within [start, start + n), window-page slots) for the positions of a row
        that have a window page to write through to."""
        if self.window_pages is None:
            return [], []
        p = self.page_size
        wp = self.row_window_pages[row]
        offs, slots = [], []
        for pos in range(start, start + n):
            w = wp[pos // p]
            if w is not None:
                offs.append(pos - start)
                slots.append(w * p + pos % p)
        return offs, slots

    # -- sharing -----------------------------------------------------------------------------
    def fork_row(self, src: int, num_tokens: int) -> int | None:
        """A new row holding the same first `num_tokens` tokens as `src`: whole full-pool
        pages are shared (ref-counted), the partly filled last page is copied (both rows
        write after it), and the rings are copied. None when no row or page is free."""
        row = self.alloc_row()
        if row is None:
            return None
        p = self.page_size
        whole, partial = divmod(num_tokens, p)
        if self.full is not None:
            shared = self.row_pages[src][:whole]
            pages = list(shared)
            if partial:
                new = self.full.allocator.alloc(1)
                if new is None:
                    self.free_row(row)
                    return None
                old = self.row_pages[src][whole]
                self.copy_kv("full", torch.arange(new[0] * p, new[0] * p + partial,
                                                  device=self.device),
                             "full", torch.arange(old * p, old * p + partial, device=self.device))
                pages += new
            self.full.allocator.incref(shared)
            self.row_pages[row] = pages
            r2t = self.rows.req_to_token
            r2t[row, :whole * p] = r2t[src, :whole * p]
            if partial:
                self._set_slots(row, whole, pages[-1:])
        if self.window_pages is not None:  # whole pages are final: share them
            shared_w = self.row_window_pages[src][:whole]
            self.window_pages.allocator.incref([w for w in shared_w if w is not None])
            self.row_window_pages[row] = list(shared_w)
        if self.state is not None:  # the state after exactly num_tokens tokens
            if self.state.consumed[src] != num_tokens:
                self.free_row(row)
                raise RuntimeError(f"fork: row {src}'s recurrent state has taken in "
                                   f"{self.state.consumed[src]} tokens, not {num_tokens}")
            self.copy_kv("state", torch.tensor([row], device=self.device),
                         "state", torch.tensor([src], device=self.device))
            self.state.consumed[row] = num_tokens
        if self.compress is not None:
            self.compress.copy_row(src, row)
        if self.window is not None:
            self.window.copy_row(src, row)
            if self.copy_log is not None:
                ring = self.window.ring
                self.copy_log.append(
                    ("ring", torch.arange(row * ring, (row + 1) * ring, device=self.device),
                     "ring", torch.arange(src * ring, (src + 1) * ring, device=self.device)))
        return row

    def checkpoint_positions(self, tokens, start: int, end: int, prompt_len: int) -> list[int]:
        """Positions in (start, end] after which a row computing positions [start, end)
        takes a state checkpoint: every `checkpoint_interval` tokens and the prompt's last
        page boundaries (those before its last token, where the same prompt hits, and at its
        end, where a longer one does), unless the tree holds one there already. `tokens(n)`
        gives the first n tokens (those known, where fewer are)."""
        if self.prefix is None or self.state is None:
            return []
        p, every = self.page_size, self.checkpoint_interval
        ends = {(prompt_len - 1) // p * p, prompt_len // p * p}
        first = -(-(start + 1) // p) * p
        at = [pos for pos in range(first, end + 1, p)
              if pos in ends or (every and pos % every == 0)]
        if not at:
            return []
        known = tokens(at[-1])
        return [pos for pos in at
                if not (pos <= len(known) and self.prefix.has_state_at(known[:pos]))]

    def take_checkpoints(self, row: int, positions: list[int]) -> list[tuple[int, int]]:
        """Checkpoint slots for the state of `row` after each of `positions` (the row holds
        them until it is freed), dropping least recently used ones of the tree where the
        budget is full: (position, state-pool slot) for those it got."""
        out = []
        alloc = self.state.checkpoints
        for pos in positions:
            if alloc.num_free == 0 and not self.prefix.evict_states(1):
                break
            ck = alloc.alloc(1)[0]
            old = self.row_checkpoints[row].get(pos)
            if old is not None:
                alloc.decref([old])
            self.row_checkpoints[row][pos] = ck
            out.append((pos, self.state.checkpoint_slot(ck)))
        return out

    def match_prefix(self, tokens: list[int]) -> Match | None:
        if self.prefix is None:
            return None
        self.prefix.query_tokens += len(tokens)
        m = self.prefix.match(tokens)
        return m if m.num_tokens else None

    def restore(self, row: int, m: Match) -> None:
        """Start `row` from a cache hit: share the hit's full pages and window pages, and copy
        the sliding KV of the W positions before the hit point into the row's ring."""
        n_pages = m.num_tokens // self.page_size
        if self.full is not None:
            self.full.allocator.incref(m.full_pages)
            self.row_pages[row] = list(m.full_pages)
            self._set_slots(row, 0, m.full_pages)
        if self.window_pages is not None:
            self.window_pages.allocator.incref([w for w in m.window_pages if w is not None])
            self.row_window_pages[row] = list(m.window_pages[:n_pages])
        if self.window is not None:
            p, ring = self.page_size, self.window.ring
            lo = max(0, m.num_tokens - self.window.window)
            pos = torch.arange(lo, m.num_tokens)
            wp = torch.tensor([m.window_pages[i // p] for i in range(lo, m.num_tokens)],
                              dtype=torch.int64)
            src = (wp * p + pos % p).to(self.window.positions.device)
            dst = (row * ring + pos % ring).to(self.window.positions.device)
            self.copy_kv("ring", dst, "window_pages", src)
            self.window.positions[dst] = pos.to(self.window.positions.device)
            if self.compress is not None:
                self.compress.restore(row, pos.to(self.window.positions.device), src)
        if self.state is not None:  # the checkpoint at the hit point into the row's slot
            self.copy_kv("state", torch.tensor([row], device=self.device), "state",
                         torch.tensor([self.state.checkpoint_slot(m.state)],
                                      device=self.device))
            self.state.consumed[row] = m.num_tokens
        self.prefix.hit_tokens += m.num_tokens

    def copy_kv(self, dst_pool: str, dst: torch.Tensor, src_pool: str, src: torch.Tensor,
                log: bool = True) -> None:
        """KV at slots `src` of one pool ("full", "ring", "window_pages") into slots `dst`
        of another, in every layer of their kind, values and scales alike (logged when
        copy_log is on)."""
        for d, s in zip(self._kv_buffers(dst_pool), self._kv_buffers(src_pool)):
            d[dst] = s[src]
        if self.compress is not None and dst_pool == src_pool == "full":
            self.compress.copy_entries(dst, src)
        if log and self.copy_log is not None:
            self.copy_log.append((dst_pool, dst, src_pool, src))

    def replay_copies(self, copies: list[tuple[str, torch.Tensor, str, torch.Tensor]]) -> None:
        """Another rank's copy_log, on this rank's shard of the same pools."""
        for dst_pool, dst, src_pool, src in copies:
            self.copy_kv(dst_pool, dst, src_pool, src, log=False)

    def take_copies(self) -> list[tuple[str, torch.Tensor, str, torch.Tensor]]:
        """The copies logged since the last call (the log starts over)."""
        out = self.copy_log or []
        if self.copy_log is not None:
            self.copy_log = []
        return out

    def _kv_buffers(self, pool: str) -> list[torch.Tensor]:
        if pool == "state":  # slots of every recurrent layer's conv and ssm buffers
            return self.state.buffers
        p = {"full": self.full, "ring": self.window, "window_pages": self.window_pages}[pool]
        return p.buffers()

    def cache_tokens(self, row: int, tokens: list[int]):
        """Insert the whole pages of `tokens` (all computed by `row`) into the prefix tree,
        with the state checkpoints the row took within them."""
        n = len(tokens) // self.page_size
        states = {pos // self.page_size: ck for pos, ck in self.row_checkpoints[row].items()
                  if pos <= n * self.page_size}
        return self.prefix.insert(tokens[:n * self.page_size], self.row_pages[row][:n],
                                  self.row_window_pages[row][:n], states)

    # -- accounting ----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of every pool tensor this cache allocated (the planner's `used_bytes`)."""
        total = self.rows.req_to_token.numel() * 8 if self.full is not None else 0
        if self.full is not None:
            total += self.full.nbytes()
        if self.window is not None:
            total += self.window.nbytes() + self.window.positions.numel() * 8
        if self.window_pages is not None:
            total += self.window_pages.nbytes()
        if self.state is not None:
            total += self.state.nbytes()
        if self.compress is not None:
            total += self.compress.nbytes()
        return total

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, free) bytes of each pool: "full" (pages), "ring" (request rows' rings),
        "window_pages" (the prefix cache's sliding-layer pages), "state" (request rows'
        recurrent state) and "state_checkpoints" (the prefix cache's)."""
        out: dict[str, tuple[int, int]] = {}
        if self.full is not None:
            a = self.full.allocator
            per = self.full.nbytes() // max(1, a.num_pages)
            out["full"] = ((a.num_pages - a.num_free) * per, a.num_free * per)
        if self.window is not None:
            per = self.window.nbytes() // max(1, self.rows.num_rows)
            free = self.rows.num_free
            out["ring"] = ((self.rows.num_rows - free) * per, free * per)
        if self.window_pages is not None:
            a = self.window_pages.allocator
            per = self.window_pages.nbytes() // max(1, a.num_pages)
            out["window_pages"] = ((a.num_pages - a.num_free) * per, a.num_free * per)
        if self.state is not None:
            per = self.state.slot_bytes()
            free = self.rows.num_free
            out["state"] = ((self.rows.num_rows - free) * per, free * per)
            a = self.state.checkpoints
            out["state_checkpoints"] = ((a.num_pages - a.num_free) * per, a.num_free * per)
        return out

    def is_fully_free(self) -> bool:
        """No row is in use and every page still allocated belongs to the prefix cache only
        (`evict_all` then returns the pools to fully free)."""
        if self.rows.num_free != self.rows.num_rows:
            return False
        held_full, held_win = self.prefix.references() if self.prefix is not None else ({}, {})
        if self.full is not None:
            used = self.full.allocator.num_pages - self.full.allocator.num_free
            if used != len(held_full):
                return False
        if self.window_pages is not None:
            a = self.window_pages.allocator
            if a.num_pages - a.num_free != len(held_win):
                return False
        if self.state is not None and self.prefix is not None:
            a = self.state.checkpoints
            if a.num_pages - a.num_free != len(self.prefix.state_references()):
                return False
        return True

    def evict_all(self) -> None:
        if self.prefix is not None:
            self.prefix.evict_all()

    def check_integrity(self) -> None:
        self.rows.check_integrity()
        if self.compress is not None:
            self.compress.check_integrity(set(self.row_pages))
        held_full, held_win = self.prefix.references() if self.prefix is not None else ({}, {})
        if self.full is not None:
            self.full.check_integrity()
            refs = Counter(p for pages in self.row_pages.values() for p in pages)
            for page, count in enumerate(self.full.allocator.refcount):
                if count != refs.get(page, 0) + held_full.get(page, 0):
                    raise AssertionError(f"full pool: page {page} has refcount {count} but "
                                         f"{refs.get(page, 0)} row and {held_full.get(page, 0)} "
                                         "cache references")
        if self.window_pages is not None:
            self.window_pages.allocator.check_integrity()
            refs = Counter(w for ws in self.row_window_pages.values() for w in ws if w is not None)
            for page, count in enumerate(self.window_pages.allocator.refcount):
                if count != refs.get(page, 0) + held_win.get(page, 0):
                    raise AssertionError(f"window pages: page {page} has refcount {count}")
        if self.state is not None:
            held = Counter(ck for cks in self.row_checkpoints.values() for ck in cks.values())
            if self.prefix is not None:
                held.update(self.prefix.state_references())
            self.state.check_integrity(held)
            if set(self.state.drafts) - set(self.row_pages):
                raise AssertionError("state pool: draft snapshots of a free row")
