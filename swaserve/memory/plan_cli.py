"""`swaserve plan`: capacity of a KV budget for a model under three accountings, side by
side. Reads only the model's config (GGUF metadata or config.json), never the weights."""

from __future__ import annotations

import argparse
import dataclasses
import json

from swaserve.config import normalize_dtype, parse_bytes
from swaserve.memory.planner import compare_accounting

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def register(sub) -> None:
    p = sub.add_parser("plan", help="KV capacity of a budget: ring vs token-scaled vs full history")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    p.add_argument("--kv-memory", required=True, help="KV budget, e.g. 4GiB")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--context", type=int, default=32768, help="tokens per request")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--swa-ratio", type=float, default=0.8,
                   help="SWA pool / full pool token ratio for token-scaled accounting")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def plan_report(args: argparse.Namespace) -> dict:
    from swaserve.checkpoint.source import resolve_model

    source = resolve_model(args.model)
    cfg = source.model_config()
    layout = cfg.cache_layout()
    dtype = normalize_dtype(args.dtype)
    budget = parse_bytes(args.kv_memory)
    acc = compare_accounting(layout, budget, DTYPE_BYTES[dtype], context=args.context,
                             chunk_size=args.chunk_size, page_size=args.page_size,
                             max_running_requests=args.max_running_requests,
                             swa_ratio=args.swa_ratio)
    return {
        "model": str(source.path), "architecture": cfg.architecture,
        "kv_memory_bytes": budget, "context": args.context, "dtype": dtype,
        "layers": {"full": list(layout.full_layers), "sliding": list(layout.sliding_layers),
                   "window": layout.max_window or None,
                   "ring": layout.ring_size(args.chunk_size, args.page_size)},
        "accounting": {k: {f: v for f, v in dataclasses.asdict(a).items() if f != "name"}
                       for k, a in acc.items()},
    }


def run(args: argparse.Namespace) -> int:
    rep = plan_report(args)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    gib = 1024**3
    print(f"{rep['architecture']} ({rep['model']})")
    lay = rep["layers"]
    print(f"layers: {len(lay['full'])} full, {len(lay['sliding'])} sliding (W={lay['window']}, "
          f"ring {lay['ring']} slots); budget {rep['kv_memory_bytes'] / gib:.2f} GiB, "
          f"context {rep['context']}, {rep['dtype']}")
    cols = ["ring", "token_scaled", "full_history"]
    rows = [("bytes per token", "bytes_per_token", "{:,.0f}"),
            ("fixed bytes per request", "fixed_bytes_per_request", "{:,}"),
            ("bytes per request at context", "bytes_per_request_at_context", "{:,}"),
            ("full-pool tokens", "full_pool_tokens", "{:,}"),
            (f"max concurrent {rep['context']}-token requests", "max_concurrent_requests", "{:,}")]
    print(f"{'':42}" + "".join(f"{c:>16}" for c in cols))
    for label, key, fmt in rows:
        print(f"{label:42}" + "".join(f"{fmt.format(rep['accounting'][c][key]):>16}" for c in cols))
    return 0
