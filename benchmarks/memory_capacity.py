"""Ring accounting, measured: with --kv-memory (1 GiB), plan the capacity for --context-token
requests (ring vs token-scaled vs full-history), then actually run that many such requests at
once on the real model and report peak RSS growth against the budget.

    python benchmarks/memory_capacity.py [--kv-memory 1GiB] [--context 8192] [--json f]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--context", type=int, default=8192)
    # long enough that every request is still decoding when the last one is admitted
    ap.add_argument("--output-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from swaserve import LLM, SamplingParams
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig, parse_bytes

    budget = parse_bytes(args.kv_memory)
    report = {}
    for ctx in sorted({args.context, 32768}):
        rep = plan_report(EngineConfig(kv_memory=args.kv_memory), context=ctx)
        report[ctx] = {k: v["max_concurrent_requests"] for k, v in rep["accounting"].items()}
        print(f"context {ctx}: max concurrent requests {report[ctx]}")
    n = report[args.context]["ring"]
    llm = LLM(kv_memory=budget, max_running_requests=n, max_model_len=args.context,
              prefix_cache=False)
    eng = llm.engine
    print(eng.plan.describe())
    base = rss_bytes()
    text = "\n".join(Path(m.__file__).read_text() for m in (argparse, json))
    ids = llm.tokenizer.encode(text * 4)[1:]
    plen = args.context - args.output_tokens
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    reqs = [eng.add_request([2] + ids[i * 101:i * 101 + plen - 1], params)[0] for i in range(n)]
    peak_running, peak, t0 = 0, base, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        peak_running = max(peak_running, len(eng.scheduler.running))
        peak = max(peak, rss_bytes())
    wall = time.perf_counter() - t0
    growth = peak - base
    out = {"plan": report, "requests": n, "peak_running": peak_running,
           "all_finished": all(r.is_finished and r.num_output_tokens == args.output_tokens for r in reqs),
           "preemptions": eng.scheduler.num_preemptions, "budget_bytes": budget,
           "rss_growth_bytes": growth, "growth_over_budget": growth / budget, "wall_s": wall}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["all_finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
