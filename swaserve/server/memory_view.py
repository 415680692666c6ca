"""The memory view: a JSON snapshot of what the KV cache holds, per running request and for
the pools as a whole, beside the planner's budget (`GET /v1/memory`, routes_ui.py).

`snapshot(engine)` reads the engine's bookkeeping and must run on the engine thread
(`AsyncEngine.call`), between two steps, where rows, pages and positions agree. It is
polled by the chat page about once a second, so it reads counters and lists the engine
already keeps: one tensor op for every row's ring fill, no walk of the prefix tree.

The shape (every count in tokens, pages, slots or bytes, as named):

    {"object": "memory",
     "plan": {budget_bytes, planned_bytes, allocated_bytes, num_rows, ring, page_size,
              full_pool_pages, full_bytes_per_token, fixed_bytes_per_row,
              window_cache_pages, state_slot_bytes, draft_state_slots,
              state_checkpoint_slots},
     "layout": {num_layers, full_layers, sliding: [{window, layers}], recurrent_layers,
                compressed_layers},
     "pool": {rows: {used, total},
              full_pages: {total, free, used, requests, cached} | null,
              window_pages: {total, free, used} | null,
              state_slots: {rows_used, rows_total, checkpoints_used, checkpoints_total}
                           | null,
              bytes: {part: {used, free}}},
     "prefix_cache": {nodes, hit_tokens, query_tokens} | null,
     "num_waiting": int,
     "requests": [{id, row, phase, prompt_tokens, output_tokens, computed_tokens,
                   cached_tokens, max_tokens,
                   full_pages, window_pages,
                   ring: {slots, filled, live: [per sliding group]} | null,
                   state: {slot, consumed, checkpoints: [positions]} | null,
                   compress: [{layer, rate, filled, span}] | null,
                   prefix_node_tokens}]}

`full_pages.requests` counts the distinct pages rows hold, `cached` the pages the prefix
tree holds (a page can be both); `used = total - free`. A request's `ring.filled` is the
slots of its ring that hold a position, and `live[i]` what of it sliding group i attends
to (its window). `prefix_node_tokens` is the cached prefix the request locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swaserve.engine.request import Request
from swaserve.memory.layout import CacheLayout
from swaserve.memory.plan import MemoryPlan
from swaserve.memory.window_pool import EMPTY

if TYPE_CHECKING:
    from swaserve.engine.engine import Engine
    from swaserve.memory.kv_cache import KVCache


def snapshot(engine: Engine) -> dict[str, Any]:
    """The memory view of `engine` now (on its thread)."""
    cache = engine.cache
    stats = engine.stats()
    running = [r for r in engine.scheduler.running if r.row is not None]
    fills = _ring_fills(cache, [r.row for r in running])
    groups = sliding_groups(cache.layout)
    return {
        "object": "memory",
        "plan": plan_dict(engine.plan, cache.nbytes()),
        "layout": layout_dict(cache.layout, groups),
        "pool": _pool(cache, stats),
        "prefix_cache": _prefix(cache),
        "num_waiting": stats.num_waiting,
        "requests": [_request(cache, r, fills.get(r.row), groups) for r in running],
    }


def plan_dict(plan: MemoryPlan, allocated: int) -> dict[str, int]:
    """The planner's sizes and budget beside the bytes the cache allocated."""
    return {
        "budget_bytes": plan.budget_bytes, "planned_bytes": plan.used_bytes,
        "allocated_bytes": allocated, "num_rows": plan.num_rows, "ring": plan.ring,
        "page_size": plan.page_size, "full_pool_pages": plan.full_pool_pages,
        "full_bytes_per_token": plan.full_bytes_per_token,
        "fixed_bytes_per_row": plan.fixed_bytes_per_row,
        "window_cache_pages": plan.window_cache_pages,
        "state_slot_bytes": plan.state_slot_bytes,
        "draft_state_slots": plan.draft_state_slots,
        "state_checkpoint_slots": plan.state_checkpoint_slots,
    }


def sliding_groups(layout: CacheLayout) -> list[dict[str, Any]]:
    """The sliding layers that store KV, grouped by window: [{window, layers}]."""
    by_window: dict[int, list[int]] = {}
    for i in layout.sliding_layers:
        by_window.setdefault(layout.layers[i].window, []).append(i)
    return [{"window": w, "layers": layers} for w, layers in sorted(by_window.items())]


def layout_dict(layout: CacheLayout, groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {"num_layers": len(layout.layers), "full_layers": list(layout.full_layers),
            "sliding": groups, "recurrent_layers": list(layout.recurrent_layers),
            "compressed_layers": list(layout.compressed_layers)}


def _pool(cache: KVCache, stats) -> dict[str, Any]:
    full = None
    if cache.full is not None:
        total, free = stats.full_pages_total, cache.full.allocator.num_free
        full = {"total": total, "free": free, "used": total - free,
                "requests": stats.request_pages, "cached": stats.prefix_cache_pages}
    window = None
    if cache.window_pages is not None:
        a = cache.window_pages.allocator
        window = {"total": a.num_pages, "free": a.num_free, "used": a.num_pages - a.num_free}
    state = None
    if cache.state is not None:
        a = cache.state.checkpoints
        state = {"rows_used": len(cache.state.row_checkpoints), "rows_total": cache.state.num_rows,
                 "checkpoints_used": a.num_pages - a.num_free, "checkpoints_total": a.num_pages}
    return {"rows": {"used": stats.rows_used, "total": stats.rows_total},
            "full_pages": full, "window_pages": window, "state_slots": state,
            "bytes": {k: {"used": u, "free": f} for k, (u, f) in stats.kv_bytes.items()}}


def _prefix(cache: KVCache) -> dict[str, int] | None:
    p = cache.prefix
    if p is None:
        return None
    return {"nodes": p.num_nodes, "hit_tokens": p.hit_tokens, "query_tokens": p.query_tokens}


def _ring_fills(cache: KVCache, rows: list[int]) -> dict[int, int]:
    """Slots of each row's ring that hold a position: one op over all rows' rings."""
    window = cache.window
    if window is None or not rows:
        return {}
    filled = (window.positions.view(window.num_rows, window.ring) != EMPTY).sum(dim=1)
    counts = filled.tolist()
    return {row: int(counts[row]) for row in rows}


def _request(cache: KVCache, req: Request, filled: int | None,
             groups: list[dict[str, Any]]) -> dict[str, Any]:
    row = req.row
    prefill = req.num_computed_tokens < req.num_prompt_tokens
    node_tokens = 0
    node = req.cache_node
    while node is not None and node.parent is not None:  # a node is one page deep
        node_tokens += len(node.tokens)
        node = node.parent
    return {
        "id": req.request_id, "row": row, "phase": "prefill" if prefill else "decode",
        "prompt_tokens": req.num_prompt_tokens, "output_tokens": req.num_output_tokens,
        "computed_tokens": req.num_computed_tokens, "cached_tokens": req.num_cached_tokens,
        "max_tokens": req.max_total_tokens,
        "full_pages": len(cache.row_pages.get(row, ())),
        "window_pages": sum(p is not None for p in cache.row_window_pages.get(row, ())),
        "ring": None if filled is None else {
            "slots": cache.window.ring, "filled": filled,
            "live": [min(filled, g["window"]) for g in groups]},
        "state": _state(cache, row),
        "compress": _compress(cache, row),
        "prefix_node_tokens": node_tokens,
    }


def _state(cache: KVCache, row: int) -> dict[str, Any] | None:
    state = cache.state
    if state is None:
        return None
    return {"slot": row, "consumed": state.consumed[row],
            "checkpoints": sorted(state.row_checkpoints.get(row, {}))}


def _compress(cache: KVCache, row: int) -> list[dict[str, int]] | None:
    """Each compressed layer's raw tokens not pooled yet, in the row's compress ring."""
    pool = cache.compress
    if pool is None:
        return None
    out = []
    for layer, st in pool.layers.items():
        span = st.spec.span
        held = st.positions[row * span:(row + 1) * span]
        out.append({"layer": layer, "rate": st.spec.rate, "span": span,
                    "filled": int((held != EMPTY).sum())})
    return out
