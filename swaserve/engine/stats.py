"""What the engine reports: one step's sizes and times, and what it holds right now."""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.engine.scheduler import Scheduler
from swaserve.engine.speculative import NgramSpeculator
from swaserve.memory.kv_cache import KVCache


@dataclass
class StepStats:
    num_tokens: int
    num_seqs: int
    seconds: float
    forward_seconds: float
    sample_seconds: float  # exact on CPU, where kernels run synchronously


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds right now (the server's gauges read this, not the pools)."""

    num_running: int
    num_waiting: int
    num_preemptions: int  # since the engine started
    rows_used: int
    rows_total: int
    full_pages_used: int
    full_pages_total: int
    request_pages: int  # full pages held by requests (the rest is the prefix cache's)
    prefix_cache_pages: int
    kv_bytes: dict[str, tuple[int, int]]  # pool -> (used, free), as KVCache.usage
    draft_tokens: tuple[int, int] = (0, 0)  # speculative tokens (verified, accepted) so far

    @classmethod
    def of(cls, sched: Scheduler, cache: KVCache,
           speculator: NgramSpeculator | None) -> EngineStats:
        spec = speculator.stats if speculator is not None else None
        return cls(
            len(sched.running), len(sched.waiting), sched.num_preemptions,
            cache.rows.num_rows - cache.rows.num_free, cache.rows.num_rows,
            cache.num_total_pages - cache.num_free_pages, cache.num_total_pages,
            len({p for pages in cache.row_pages.values() for p in pages}),
            cache.prefix.num_nodes if cache.prefix is not None else 0, cache.usage(),
            (spec.proposed, spec.accepted) if spec is not None else (0, 0))
