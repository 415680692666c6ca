"""MemoryPlan: the pool sizes the planner (memory/planner.py) chose for a byte budget, and
what they cost; `used_bytes` is what KVCache allocates for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swaserve.memory.kv_quant import KVFormat


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    num_rows: int
    ring: int  # slots per row per sliding layer (0: no window pool)
    page_size: int
    full_pool_pages: int  # 0: no full pool
    full_bytes_per_token: int
    fixed_bytes_per_row: int
    window_cache_pages: int = 0  # prefix cache: sliding-layer KV pages of cached tokens
    window_bytes_per_token: int = 0
    # the state pool (recurrent layers): one slot's bytes (each row's is in
    # fixed_bytes_per_row), the slots for a speculative step's snapshots, and the prefix
    # cache's state checkpoints
    state_slot_bytes: int = 0
    draft_state_slots: int = 0
    state_checkpoint_slots: int = 0
    # how the pools store K/V (`kv_cache_dtype`, made once by plan_kv); None: the compute
    # dtype, for a plan made without a config. Plans compare by their sizes alone.
    kv_format: KVFormat | None = field(default=None, compare=False)

    @property
    def full_pool_tokens(self) -> int:
        return self.full_pool_pages * self.page_size

    @property
    def used_bytes(self) -> int:
        return (self.num_rows * self.fixed_bytes_per_row
                + self.full_pool_tokens * self.full_bytes_per_token
                + self.window_cache_pages * self.page_size * self.window_bytes_per_token
                + (self.draft_state_slots + self.state_checkpoint_slots)
                * self.state_slot_bytes)

    def describe(self) -> str:
        gib = 1024**3
        return (f"KV plan: budget {self.budget_bytes / gib:.2f} GiB -> {self.num_rows} request rows "
                f"(ring {self.ring} slots, {self.fixed_bytes_per_row / 2**20:.1f} MiB each), "
                f"full pool {self.full_pool_tokens} tokens in {self.full_pool_pages} pages of "
                f"{self.page_size} ({self.full_bytes_per_token} B/token), prefix-cache window "
                f"pages {self.window_cache_pages}"
                + (f", recurrent state {self.state_slot_bytes / 2**20:.1f} MiB a row "
                   f"(+{self.draft_state_slots} draft snapshots, "
                   f"{self.state_checkpoint_slots} prefix checkpoints)"
                   if self.state_slot_bytes else "")
                + f"; uses {self.used_bytes / gib:.3f} GiB")
