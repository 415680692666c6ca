"""Memory planner: turns one byte budget into pool sizes by ring accounting.

Ring accounting charges what windowed storage really uses:
- fixed, per request row: `ring * sum_sliding(kv bytes/token)` plus any per-request state
  (a recurrent layer's conv window and recurrent matrices: memory/state_pool.py);
- per token: `sum_full(kv bytes/token)` only.
Beside the rows, the state pool's other slots are fixed bytes too: a speculative step's
draft snapshots and the prefix cache's state checkpoints (their own budget,
`state_cache_bytes`).
Sums run over the layers that store KV, each at its own shape: a layer that reuses another
layer's KV (Gemma 4's shared layers) is charged nothing.
Full-pool tokens = (budget - rows * fixed) / per-token bytes, rounded down to whole pages.
`compare_accounting` puts this beside token-scaled accounting (sliding layers charged per
token, as engines that pool SWA KV by token do) and full-history storage (no windowing);
both of those charge a recurrent layer per token too, as the KV of its own key and value
heads: what a pool that holds every layer's state by token would reserve for it.
`plan_kv` is the budget an engine's config asks for, planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from swaserve.config import TORCH_DTYPES, EngineConfig, parse_bytes
from swaserve.memory.compress_pool import compress_row_bytes
from swaserve.memory.kv_quant import kv_format
from swaserve.memory.layout import CacheLayout, LayerKind
from swaserve.memory.plan import MemoryPlan
from swaserve.memory.pool import Sizing
from swaserve.memory.pool_kinds import plan_costs
from swaserve.memory.window_pool import sliding_bytes_per_token

MAX_DEFAULT_ROWS = 256
DEFAULT_KV_MEMORY = 1024**3


def full_bytes_per_token(layout: CacheLayout, dtype_bytes: int, scale_bytes: int = 0) -> int:
    """KV bytes a token costs in the full layers that store it (each at its own shape; a
    layer that reuses another's KV costs nothing), in compressed entries (DeepSeek-V4's,
    paged with the full pool's pages at one per `rate` tokens); `scale_bytes` per KV head
    when quantized: the pools' per-token costs."""
    return plan_costs(layout, Sizing(dtype_bytes, scale_bytes)).token


def recurrent_history_bytes_per_token(layout: CacheLayout, dtype_bytes: int) -> int:
    """What the recurrent layers would keep per token as the KV of their own key and value
    heads (channels = 2 key + value widths): what a pool holding every layer's state by
    token would charge them."""
    total = 0
    for i in layout.recurrent_layers:
        spec = layout.layers[i]
        channels, (heads, _, dv) = spec.conv_state[0], spec.recurrent_state
        total += ((channels - heads * dv) // 2 + heads * dv) * dtype_bytes
    return total


def fixed_bytes_per_row(layout: CacheLayout, ring: int, dtype_bytes: int,
                        max_model_len: int = 0, scale_bytes: int = 0) -> int:
    """What one request row prepays in every pool (its rings and their recorded
    positions, a recurrent layer's conv window and matrices, compressed layers' rings, and
    with `max_model_len` its req-to-token row), and the state a layer declares beside its
    KV that no pool holds (`LayerSpec.fixed_state_bytes`)."""
    sizing = Sizing(dtype_bytes, scale_bytes, ring, max_model_len)
    beside = sum(s.fixed_state_bytes for s in layout.layers if s.kind is not LayerKind.RECURRENT)
    return plan_costs(layout, sizing).row + beside


def plan_memory(layout: CacheLayout, budget_bytes: int, dtype_bytes: int, *, chunk_size: int,
                page_size: int, max_model_len: int, max_running_requests: int | None = None,
                window_cache_bytes: int = 0, draft_state_slots: int = 0,
                state_cache_bytes: int = 0, scale_bytes: int = 0) -> MemoryPlan:
    """Size the pools for `budget_bytes`, of which `window_cache_bytes` go to the prefix
    cache's window pages and `state_cache_bytes` to its state checkpoints; a model with
    recurrent layers also keeps `draft_state_slots` snapshots for speculative steps. K/V
    cost `dtype_bytes` a value and, quantized, `scale_bytes` a KV head. Raises ValueError
    when the budget cannot hold one request row plus one page of full KV."""
    costs = plan_costs(layout, Sizing(dtype_bytes, scale_bytes))
    # a window page holds its tokens' sliding KV and, for compressed layers, their raw state
    swa_bpt = costs.cached_token
    window_pages = window_cache_bytes // (swa_bpt * page_size) if swa_bpt else 0
    slot = costs.slot
    drafts = draft_state_slots if slot else 0
    checkpoints = state_cache_bytes // slot if slot else 0
    budget_all = budget_bytes
    budget_bytes -= window_pages * swa_bpt * page_size + (drafts + checkpoints) * slot
    ring = layout.ring_size(chunk_size, page_size)
    fixed = fixed_bytes_per_row(layout, ring, dtype_bytes, max_model_len, scale_bytes)
    per_token = costs.token
    page_bytes = per_token * page_size
    if max_running_requests is None:
        # Give each row its ring plus a ring's worth of full-pool tokens on average.
        per_row = fixed + per_token * max(ring, chunk_size)
        rows = max(1, min(MAX_DEFAULT_ROWS, budget_bytes // max(per_row, 1)))
    else:
        rows = max_running_requests
    remaining = budget_bytes - rows * fixed
    if remaining < 0 or (per_token and remaining < page_bytes):
        need = rows * fixed + page_bytes
        raise ValueError(
            f"kv_memory: {budget_bytes} bytes cannot hold {rows} request rows "
            f"({fixed} bytes each for sliding-window rings and recurrent state) plus one "
            "full-KV page; "
            f"need at least {need} bytes, or lower max_running_requests")
    if per_token:
        pages = remaining // page_bytes
        # more than every row at max length is never used
        useful = rows * (-(-max_model_len // page_size))
        pages = min(pages, useful)
    else:
        pages = 0
    return MemoryPlan(budget_bytes=budget_all, num_rows=rows, ring=ring, page_size=page_size,
                      full_pool_pages=pages, full_bytes_per_token=per_token,
                      fixed_bytes_per_row=fixed, window_cache_pages=window_pages,
                      window_bytes_per_token=swa_bpt, state_slot_bytes=slot,
                      draft_state_slots=drafts, state_checkpoint_slots=checkpoints)


@dataclass(frozen=True)
class Accounting:
    name: str
    bytes_per_token: float
    fixed_bytes_per_request: int
    full_pool_tokens: int
    max_concurrent_requests: int
    bytes_per_request_at_context: int


def compare_accounting(layout: CacheLayout, budget_bytes: int, dtype_bytes: int, *,
                       context: int, chunk_size: int, page_size: int,
                       max_running_requests: int | None = None,
                       swa_ratio: float = 0.8, scale_bytes: int = 0) -> dict[str, Accounting]:
    """Capacity of one budget under ring accounting, token-scaled accounting (a shared SWA
    token pool sized `swa_ratio` x the full pool, as SGLang's swa_full_tokens_ratio does) and
    full-history storage, for requests of `context` tokens."""
    full_bpt = full_bytes_per_token(layout, dtype_bytes, scale_bytes)
    swa_bpt = sliding_bytes_per_token(layout, dtype_bytes, scale_bytes)
    rec_bpt = recurrent_history_bytes_per_token(layout, dtype_bytes)
    ring = layout.ring_size(chunk_size, page_size)
    fixed = fixed_bytes_per_row(layout, ring, dtype_bytes, scale_bytes=scale_bytes)
    ctx_tokens = -(-context // page_size) * page_size
    cap = max_running_requests

    def bound(n: int) -> int:
        return max(0, n if cap is None else min(n, cap))

    # (a) ring: each request prepays its ring; full layers per token
    per_req = fixed + ctx_tokens * full_bpt
    n_ring = bound(budget_bytes // per_req if per_req else 0)
    rows = cap if cap is not None else max(n_ring, 1)
    ring_tokens = ((max(budget_bytes - rows * fixed, 0) // (full_bpt * page_size)) * page_size
                   if full_bpt else 0)
    ring_acc = Accounting("ring", full_bpt, fixed, ring_tokens, n_ring, per_req)

    # (b) token-scaled: every full-pool token is charged swa_ratio tokens of SWA KV as well,
    # compressed layers' state one row's rings per page of those (SGLang's c4 state pool
    # before its per-request rings: ring / page rows per SWA token), and recurrent layers
    # their own q/k/v heads' KV per token
    ts_bpt = (full_bpt + swa_ratio * (swa_bpt + compress_row_bytes(layout, dtype_bytes)
                                      / page_size) + rec_bpt)
    ts_tokens = int(budget_bytes // ts_bpt) // page_size * page_size if ts_bpt else 0
    if full_bpt:
        n_ts = ts_tokens // ctx_tokens
        swa_pool = int(swa_ratio * ts_tokens)
        if swa_bpt:  # each request also keeps min(context, ring) tokens in the SWA pool
            n_ts = min(n_ts, swa_pool // max(1, min(ctx_tokens, ring)))
    else:
        n_ts = ts_tokens // max(1, min(ctx_tokens, ring))
    ts_acc = Accounting("token_scaled", ts_bpt, 0, ts_tokens, bound(n_ts),
                        int(ctx_tokens * ts_bpt))

    # (c) full history: every layer keeps every token
    fh_bpt = full_bpt + swa_bpt + rec_bpt
    fh_tokens = (budget_bytes // (fh_bpt * page_size)) * page_size if fh_bpt else 0
    fh_acc = Accounting("full_history", fh_bpt, 0, fh_tokens, bound(fh_tokens // ctx_tokens),
                        ctx_tokens * fh_bpt)
    return {"ring": ring_acc, "token_scaled": ts_acc, "full_history": fh_acc}


def plan_kv(config: EngineConfig, layout: CacheLayout, max_model_len: int,
            device: torch.device, prefix_cache: bool, pending_bytes: int = 0) -> MemoryPlan:
    """Pool sizes for the KV budget: `kv_memory`, else `mem_fraction` of free memory (less
    `pending_bytes`, what the model will still allocate: `CausalLM.pending_bytes`), else
    1 GiB; the prefix cache's window pages take `window_cache_memory` (a fifth) of it, its
    state checkpoints `state_cache_memory` (a fifth). K/V cost what `kv_cache_dtype` stores:
    values and their scales."""
    budget = config.kv_memory_bytes
    if budget is None and config.mem_fraction is not None:
        free = max(_free_memory_bytes(device) - pending_bytes, 0)
        budget = int(free * config.mem_fraction)
    budget = budget or DEFAULT_KV_MEMORY
    window_cache = 0
    if prefix_cache and layout.sliding_layers:
        window_cache = (parse_bytes(config.window_cache_memory) if config.window_cache_memory
                        else budget // 5)
    state_cache = 0
    if prefix_cache and layout.recurrent_layers:
        state_cache = (parse_bytes(config.state_cache_memory) if config.state_cache_memory
                       else budget // 5)
    if config.kv_cache_dtype != "auto" and (layout.recurrent_layers or layout.compressed_layers):
        # their state is planned in the model dtype, which a quantized format's bytes are not
        raise ValueError("kv_cache_dtype: a quantized KV cache is not available for models "
                         "with recurrent or compressed-attention layers (Qwen3.5, DeepSeek-V4)")
    fmt = kv_format(config.kv_cache_dtype, TORCH_DTYPES[config.dtype])
    plan = plan_memory(layout, budget, fmt.value_bytes,
                       chunk_size=config.step_tokens, page_size=config.page_size,
                       max_model_len=max_model_len,
                       max_running_requests=config.max_running_requests,
                       window_cache_bytes=window_cache,
                       draft_state_slots=config.draft_state_slots,
                       state_cache_bytes=state_cache, scale_bytes=fmt.scale_bytes)
    return dataclasses.replace(plan, kv_format=fmt)  # the caches built from it store this


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return DEFAULT_KV_MEMORY
