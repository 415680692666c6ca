"""`swaserve plan`: capacity of a KV budget for a model under three accountings, side by
side. Reads only the model's config (GGUF metadata or config.json), never the weights."""

from __future__ import annotations

import argparse
import dataclasses
import json

from swaserve.cli.args import add_engine_args, add_model_arg, engine_config
from swaserve.config import DTYPE_BYTES, TORCH_DTYPES, EngineConfig
from swaserve.memory.kv_quant import KVFormat, kv_format
from swaserve.memory.layout import CacheLayout
from swaserve.memory.planner import compare_accounting, recurrent_history_bytes_per_token

PLAN_FIELDS = ("model", "revision", "kv_memory", "max_running_requests", "chunk_size", "page_size", "dtype",
               "kv_cache_dtype", "speculative", "num_draft_tokens", "tensor_parallel_size")


def register(sub) -> None:
    p = sub.add_parser("plan", help="KV capacity of a budget: ring vs token-scaled vs full history")
    add_model_arg(p)
    p.add_argument("--context", type=int, default=32768, help="tokens per request")
    p.add_argument("--swa-ratio", type=float, default=0.8,
                   help="SWA pool / full pool token ratio for token-scaled accounting")
    p.add_argument("--json", action="store_true")
    add_engine_args(p, only=PLAN_FIELDS)
    p.set_defaults(func=run)


def plan_report(config: EngineConfig, context: int = 32768, swa_ratio: float = 0.8) -> dict:
    """Capacity of `config.kv_memory` for `config.model` under the three accountings; with
    tensor_parallel_size > 1 the budget and the bytes are one rank's (its KV heads)."""
    from swaserve.checkpoint.shard import local_config
    from swaserve.checkpoint.source import resolve_model

    if config.kv_memory is None:
        raise ValueError("kv_memory: plan needs a budget, e.g. --kv-memory 4GiB")
    source = resolve_model(config.model, config.revision)
    cfg = source.model_config()
    tp = config.tensor_parallel_size
    layout = local_config(cfg, tp).cache_layout(
        config.num_draft_tokens if config.speculative else 0)
    budget = config.kv_memory_bytes
    dtype_bytes = DTYPE_BYTES[config.dtype]

    fmt = kv_format(config.kv_cache_dtype, TORCH_DTYPES[config.dtype])

    def accounting(lay, fmt: KVFormat = fmt) -> dict:
        acc = compare_accounting(lay, budget, fmt.value_bytes, context=context,
                                 chunk_size=config.step_tokens, page_size=config.page_size,
                                 max_running_requests=config.max_running_requests,
                                 swa_ratio=swa_ratio, scale_bytes=fmt.scale_bytes)
        return {k: {f: v for f, v in dataclasses.asdict(a).items() if f != "name"}
                for k, a in acc.items()}

    return {
        "model": source.hub_id or str(source.path), "architecture": cfg.architecture,
        "kv_memory_bytes": budget, "context": context, "dtype": config.dtype,
        "kv_cache_dtype": fmt.name,
        "tensor_parallel_size": tp, "kv_heads_per_rank": local_config(cfg, tp).num_kv_heads,
        "layers": _layers_report(layout, config, dtype_bytes),
        "recurrent": _recurrent_report(layout, dtype_bytes),
        "accounting": accounting(layout),
        # a quantized cache beside the compute dtype's, the same budget
        "unquantized_accounting": (accounting(layout, kv_format("auto", TORCH_DTYPES[config.dtype]))
                                   if config.kv_cache_dtype != "auto" else None),
        # as if every layer stored its own KV: what sharing saves, side by side
        "without_kv_sharing": (accounting(layout.without_sharing())
                               if layout.reusing_layers else None),
    }


def _layers_report(layout: CacheLayout, config: EngineConfig, dtype_bytes: int) -> dict:
    """The layers' kinds, KV shapes, window and ring, and compressed layers' state."""
    shapes = {spec.kind.value: [spec.num_kv_heads, spec.head_dim] for spec in layout.layers
              if spec.conv_state is None}
    ring = layout.ring_size(config.step_tokens, config.page_size)
    return {"full": list(layout.full_layers), "sliding": list(layout.sliding_layers),
            # layers that read another layer's KV and store none (Gemma 4)
            "reusing": list(layout.reusing_layers),
            "kv_shape": shapes,  # [KV heads, head size] of each kind's layers
            "window": layout.max_window or None,
            "ring": ring,
            # slots a ring adds for a draft that writes more than a chunk
            "draft_allowance": ring - layout.ring_size(config.chunk_size, config.page_size),
            "step_tokens": config.step_tokens,
            # DeepSeek-V4: [layer, rate, raw-token ring slots, entry bytes per token, ring
            # bytes per request] of each compressed layer
            "compressed": [[i, layout.layers[i].compress.rate,
                            layout.layers[i].compress.span,
                            layout.layers[i].compress.entry_bytes_per_token(dtype_bytes),
                            layout.layers[i].compress.ring_bytes(dtype_bytes)]
                           for i in layout.compressed_layers]}


def _recurrent_report(layout: CacheLayout, dtype_bytes: int) -> dict | None:
    """Per-request state beside the KV (Qwen3.5's Gated DeltaNet layers), or None."""
    rec = layout.recurrent_layers
    if not rec:
        return None
    spec = layout.layers[rec[0]]
    return {
        "layers": list(rec), "conv_state": list(spec.conv_state),
        "recurrent_state": list(spec.recurrent_state),
        "state_bytes_per_request": layout.state_bytes_per_row(dtype_bytes),
        # what a pool holding every layer's state by token would charge them
        "history_bytes_per_token": recurrent_history_bytes_per_token(layout, dtype_bytes),
    }


def run(args: argparse.Namespace) -> int:
    rep = plan_report(engine_config(args), args.context, args.swa_ratio)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    gib = 1024**3
    print(f"{rep['architecture']} ({rep['model']})")
    lay = rep["layers"]
    rec = rep["recurrent"]
    if rec is None:
        print(f"layers: {len(lay['full'])} full, {len(lay['sliding'])} sliding "
              f"(W={lay['window']}, ring {lay['ring']} slots: W + {lay['step_tokens']} tokens "
              f"a step, {lay['draft_allowance']} of them for drafts)")
    else:
        print(f"layers: {len(lay['full'])} full, {len(rec['layers'])} recurrent (Gated DeltaNet)")
    print(f"budget {rep['kv_memory_bytes'] / gib:.2f} GiB, context {rep['context']}, "
          f"{rep['dtype']}, KV cache {rep['kv_cache_dtype']}")
    if rec is not None:
        c, w = rec["conv_state"]
        h, dk, dv = rec["recurrent_state"]
        mib = rec["state_bytes_per_request"] / 2**20
        hist = rec["history_bytes_per_token"]
        print(f"recurrent state per request: {mib:.1f} MiB whatever the context (a layer: "
              f"conv window {c} x {w}, {rep['dtype']}; state {h} x {dk} x {dv}, float32), "
              f"prepaid with its row; token-scaled and full-history accounting charge these "
              f"layers {hist:,} B a token ({hist * rep['context'] / 2**20:.1f} MiB at "
              f"context)")
    if rep["tensor_parallel_size"] > 1:
        print(f"per rank of {rep['tensor_parallel_size']}: {rep['kv_heads_per_rank']} KV heads "
              f"a layer, the budget above on each rank")
    if lay["reusing"]:
        print(f"KV shared: layers {lay['reusing']} reuse an earlier layer's KV and store none")
    if len({tuple(v) for v in lay["kv_shape"].values()}) > 1:
        print("KV heads x head size: " + ", ".join(f"{k} {h} x {d}"
                                                   for k, (h, d) in lay["kv_shape"].items()))
    if lay["compressed"]:
        rates: dict[int, list] = {}
        for _, rate, span, per_token, ring in lay["compressed"]:
            rates.setdefault(rate, []).append((span, per_token, ring))
        print("compressed: " + "; ".join(
            f"{len(v)} layers at rate {r} ({v[0][1]} B/token of entries, a ring of {v[0][0]} "
            f"raw tokens = {v[0][2]:,} B/request each)" for r, v in sorted(rates.items())))
    _table(rep["accounting"], rep["context"])
    if rep["unquantized_accounting"] is not None:
        print(f"with a {rep['dtype']} KV cache (--kv-cache-dtype auto):")
        _table(rep["unquantized_accounting"], rep["context"])
    if rep["without_kv_sharing"] is not None:
        print("without KV sharing (every layer storing its own KV):")
        _table(rep["without_kv_sharing"], rep["context"])
    return 0


def _table(acc: dict, context: int) -> None:
    cols = ["ring", "token_scaled", "full_history"]
    rows = [("bytes per token", "bytes_per_token", "{:,.0f}"),
            ("fixed bytes per request", "fixed_bytes_per_request", "{:,}"),
            ("bytes per request at context", "bytes_per_request_at_context", "{:,}"),
            ("full-pool tokens", "full_pool_tokens", "{:,}"),
            (f"max concurrent {context}-token requests", "max_concurrent_requests", "{:,}")]
    print(f"{'':42}" + "".join(f"{c:>16}" for c in cols))
    for label, key, fmt in rows:
        print(f"{label:42}" + "".join(f"{fmt.format(acc[c][key]):>16}" for c in cols))
