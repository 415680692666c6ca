"""The state pool: per recurrent layer (Qwen3.5's Gated DeltaNet), one causal-conv window and
one recurrent state per *slot*, whatever the context length.

Address scheme: slot `s` of recurrent layer `d` (dense recurrent index) is `conv[d][s]`
([channels, kernel - 1], the model dtype: the last kernel - 1 inputs of the convolution)
and `ssm[d][s]` ([heads, d_k, d_v], float32). Slots come in three regions:
- `[0, rows)`: request row `r`'s state is slot `r`, reset to zeros when the row is newly
  allocated (RequestRows' alloc hook: a chunked continuation keeps its state), copied on
  n > 1 forks, and freed with the row (nothing to do: the next owner resets it);
- `[rows, rows + draft_slots)`: a speculative step's snapshots: the state after each token
  of a drafted decode but its last (which lands in the row's slot), so that rejected draft
  tokens never advance the state (`select_draft`: the accepted position's snapshot back
  into the row's slot). A drafted step is never chained behind another (engine.py), so the
  region is free again at the next step;
- `[rows + draft_slots, total)`: prefix-cache checkpoints (`checkpoints`, ref-counted: held
  by the row that wrote one until the prefix tree takes it, then by its tree node).

`consumed[r]` is how many tokens row r's state has taken in (host-side bookkeeping, checked
by the runner before every step): a row's next computed position must equal it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from swaserve.memory.layout import CacheLayout
from swaserve.memory.pages import PageAllocator
from swaserve.memory.pool import Copy, Costs, Pool, PoolEnv, Sizing

if TYPE_CHECKING:
    from swaserve.memory.plan import MemoryPlan
    from swaserve.memory.prefix_cache import Match


class StatePool(Pool):
    kind = "state"

    def __init__(self, layout: CacheLayout, num_rows: int, draft_slots: int,
                 checkpoint_slots: int, dtype: torch.dtype, device: torch.device | str,
                 kv_device: torch.device | str | None = None):
        kv_device = kv_device or device
        self.num_rows = num_rows
        self.draft_base = num_rows
        self.draft_slots = draft_slots
        self.checkpoint_base = num_rows + draft_slots
        self.num_slots = num_rows + draft_slots + checkpoint_slots
        self.device = kv_device
        self.index_device = device  # where copies' slot indices go (KVCache.copy_kv)
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        for i in layout.recurrent_layers:
            spec = layout.layers[i]
            self.conv.append(torch.zeros((self.num_slots, *spec.conv_state), dtype=dtype,
                                         device=kv_device))
            self.ssm.append(torch.zeros((self.num_slots, *spec.recurrent_state),
                                        dtype=torch.float32, device=kv_device))
        self.consumed = [0] * num_rows
        # row -> (first position of its drafted seq this step, snapshot slots after each
        # of the seq's tokens but the last)
        self.drafts: dict[int, tuple[int, list[int]]] = {}
        self.checkpoints = PageAllocator(checkpoint_slots, 1)
        # checkpoints a row took and holds until it is freed: position -> checkpoint; the
        # prefix tree takes its own reference when the row caches them
        self.row_checkpoints: dict[int, dict[int, int]] = {}

    @classmethod
    def declared(cls, layout: CacheLayout) -> bool:
        return bool(layout.recurrent_layers)

    @classmethod
    def costs(cls, layout: CacheLayout, sizing: Sizing) -> Costs:
        """A slot's conv windows and matrices, once per row and once per other slot."""
        slot = layout.state_bytes_per_row(sizing.dtype_bytes)
        return Costs(row=slot, slot=slot)

    @classmethod
    def create(cls, layout: CacheLayout, plan: MemoryPlan, env: PoolEnv) -> StatePool:
        return cls(layout, plan.num_rows, plan.draft_state_slots, plan.state_checkpoint_slots,
                   env.dtype, env.device, env.kv_device)

    # -- accounting ------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    def pool_bytes(self) -> int:
        return self.nbytes()

    def slot_bytes(self) -> int:
        """Bytes of one slot over every recurrent layer."""
        return self.nbytes() // max(1, self.num_slots)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every layer's conv and ssm buffers, indexed by slot (KVCache.copy_kv)."""
        return self.conv + self.ssm

    # -- rows ------------------------------------------------------------------------------
    def reset_rows(self, rows: list[int]) -> None:
        """Alloc hook: a new request's state starts at zeros, having taken in nothing."""
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        for buf in self.buffers:
            buf.index_fill_(0, idx, 0)
        for r in rows:
            self.consumed[r] = 0
            self.drafts.pop(r, None)
            self.row_checkpoints[r] = {}

    def free_row(self, row: int) -> None:
        self.drafts.pop(row, None)
        held = list(self.row_checkpoints.pop(row).values())
        if held:
            self.checkpoints.decref(held)

    def _copy(self, dst: int, src: int) -> Copy:
        dev = self.index_device
        return ("state", torch.tensor([dst], device=dev), "state", torch.tensor([src], device=dev))

    def fork(self, src: int, dst: int, num_tokens: int) -> list[Copy] | None:
        """The state after exactly `num_tokens` tokens."""
        if self.consumed[src] != num_tokens:
            raise RuntimeError(f"fork: row {src}'s recurrent state has taken in "
                               f"{self.consumed[src]} tokens, not {num_tokens}")
        self.consumed[dst] = num_tokens
        return [self._copy(dst, src)]

    def discard(self, row: int, start: int, end: int) -> list[Copy]:
        """A recurrent state is not rewritten: it takes the snapshot of the drafted step
        after position start - 1 (`select_draft`)."""
        if row not in self.drafts:
            return []
        return [self._copy(dst, src) for dst, src in self.select_draft(row, start)]

    # -- drafts ----------------------------------------------------------------------------
    def draft_region(self) -> range:
        return range(self.draft_base, self.draft_base + self.draft_slots)

    def select_draft(self, row: int, keep: int) -> list[tuple[int, int]]:
        """Row `row` keeps positions [0, keep) of its drafted step: the (dst, src) slot copy
        that puts the state after position keep - 1 into its slot (none when that is the
        step's last position, already there). The step's snapshots are dropped."""
        start, snaps = self.drafts.pop(row)
        j = keep - 1 - start  # index of the last kept token within the drafted seq
        if not 0 <= j <= len(snaps):
            raise RuntimeError(f"state pool: row {row} keeps {keep} tokens, outside its "
                               f"drafted step [{start}, {start + len(snaps) + 1})")
        self.consumed[row] = keep
        return [] if j == len(snaps) else [(row, snaps[j])]

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint_slot(self, page: int) -> int:
        return self.checkpoint_base + page

    def checkpoint_positions(self, tokens, start: int, end: int, prompt_len: int,
                             every: int) -> list[int]:
        """Positions in (start, end] after which a row computing positions [start, end)
        takes a checkpoint: every `every` tokens and the prompt's last page boundaries
        (those before its last token, where the same prompt hits, and at its end, where a
        longer one does), unless the tree holds one there already; none without a prefix
        tree. `tokens(n)` gives the first n tokens (those known, where fewer are)."""
        if self.prefix is None:
            return []
        p = self.prefix.page_size
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
        alloc = self.checkpoints
        for pos in positions:
            if alloc.num_free == 0 and not self.prefix.evict_states(1):
                break
            ck = alloc.alloc(1)[0]
            old = self.row_checkpoints[row].get(pos)
            if old is not None:
                alloc.decref([old])
            self.row_checkpoints[row][pos] = ck
            out.append((pos, self.checkpoint_slot(ck)))
        return out

    # -- the prefix cache ------------------------------------------------------------------
    def prefix_parts(self) -> dict[str, Any] | None:
        if self.checkpoints.num_pages == 0:
            return None  # a hit needs a checkpoint
        return {"state_alloc": self.checkpoints}

    def cached(self, row: int, num_pages: int) -> dict[str, Any]:
        """The checkpoints the row took within its first `num_pages` pages, by page count."""
        p = self.prefix.page_size
        return {"states": {pos // p: ck for pos, ck in self.row_checkpoints[row].items()
                           if pos <= num_pages * p}}

    def restore(self, row: int, match: Match) -> list[Copy]:
        """The checkpoint at the hit point into the row's slot."""
        self.consumed[row] = match.num_tokens
        return [self._copy(row, self.checkpoint_slot(match.state))]

    def only_cached(self) -> bool:
        if self.prefix is None:
            return True
        a = self.checkpoints
        return a.num_pages - a.num_free == len(self.prefix.state_references())

    # -- copies, accounting, checks --------------------------------------------------------
    def slot_buffers(self, space: str) -> list[torch.Tensor] | None:
        return self.buffers if space == "state" else None

    def usage(self) -> dict[str, tuple[int, int]]:
        per = self.slot_bytes()
        used = len(self.row_checkpoints)
        free = self.num_rows - used
        a = self.checkpoints
        return {"state": (used * per, free * per),
                "state_checkpoints": ((a.num_pages - a.num_free) * per, a.num_free * per)}

    def check_integrity(self, used_rows: set[int]) -> None:
        """Checkpoints' refcounts equal their holders (rows and the prefix tree); draft
        snapshots only of rows in use."""
        held = Counter(ck for cks in self.row_checkpoints.values() for ck in cks.values())
        if self.prefix is not None:
            held.update(self.prefix.state_references())
        a = self.checkpoints
        a.check_integrity()
        for page, count in enumerate(a.refcount):
            if count != held.get(page, 0):
                raise AssertionError(f"state checkpoints: checkpoint {page} has refcount "
                                     f"{count} but {held.get(page, 0)} holders")
        if set(self.drafts) - used_rows:
            raise AssertionError("state pool: draft snapshots of a free row")
