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

import torch

from swaserve.memory.full_pool import PageAllocator
from swaserve.memory.layout import CacheLayout


class StatePool:
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

    # -- accounting ------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

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

    def check_integrity(self, held: dict[int, int]) -> None:
        """`held`: checkpoint -> references the rows and the prefix tree hold."""
        a = self.checkpoints
        a.check_integrity()
        for page, count in enumerate(a.refcount):
            if count != held.get(page, 0):
                raise AssertionError(f"state checkpoints: checkpoint {page} has refcount "
                                     f"{count} but {held.get(page, 0)} holders")
