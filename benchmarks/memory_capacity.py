"""Ring accounting, measured: with --kv-memory (1 GiB), plan the capacity for --context-token
requests (ring vs token-scaled vs full-history) for each --kv-cache-dtype, then actually run
that many such requests at once on the real model and report peak RSS growth against the
budget. With --decode, instead: decode tok/s with each KV dtype at batch 32 after 128-token
prompts and at --long-batch requests of --context tokens (attention reads dominate there),
over --decode-tokens steps in which every request decodes.

    python benchmarks/memory_capacity.py [--kv-memory 1GiB] [--context 8192]
        [--kv-cache-dtype auto int8] [--decode] [--json f]
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


def text_ids(tokenizer) -> list[int]:
    text = "\n".join(Path(m.__file__).read_text() for m in (argparse, json))
    return tokenizer.encode(text * 4)[1:]


def capacity_run(args, kv: str) -> dict:
    """Plan the requests of --context tokens the budget holds, then run them all at once."""
    from swaserve import LLM, SamplingParams
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig, parse_bytes

    budget = parse_bytes(args.kv_memory)
    report = {}
    for ctx in sorted({args.context, 32768}):
        rep = plan_report(EngineConfig(kv_memory=args.kv_memory, kv_cache_dtype=kv), context=ctx)
        report[ctx] = {k: v["max_concurrent_requests"] for k, v in rep["accounting"].items()}
        print(f"{kv}: context {ctx}: max concurrent requests {report[ctx]}")
    n = report[args.context]["ring"]
    llm = LLM(kv_memory=budget, max_running_requests=n, max_model_len=args.context,
              prefix_cache=False, kv_cache_dtype=kv)
    eng = llm.engine
    print(eng.plan.describe())
    base = rss_bytes()
    ids = text_ids(llm.tokenizer)
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
    return {"plan": report, "requests": n, "peak_running": peak_running,
            "all_finished": all(r.is_finished and r.num_output_tokens == args.output_tokens
                                for r in reqs),
            "preemptions": eng.scheduler.num_preemptions, "budget_bytes": budget,
            "rss_growth_bytes": growth, "growth_over_budget": growth / budget, "wall_s": wall}


def decode_rate(kv: str, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """Decode tok/s of `batch` greedy requests of `prompt_tokens`: the tokens of the
    `new_tokens` steps after every request has its first, each step decoding every request
    (prefill excluded; the requests admitted first, already decoding, are never finished
    before the window ends), then the requests are aborted."""
    from swaserve import LLM, SamplingParams

    room = 4 * new_tokens  # outputs of the early requests while the later ones prefill
    llm = LLM(kv_memory="2GiB", max_running_requests=batch, prefix_cache=False,
              kv_cache_dtype=kv, max_model_len=prompt_tokens + room + 16)
    eng = llm.engine
    ids = text_ids(llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    reqs = [eng.add_request([2] + ids[i * 37:i * 37 + prompt_tokens - 1], params)[0]
            for i in range(batch)]
    while not all(r.num_output_tokens for r in reqs):
        eng.step()
    done, t0 = sum(r.num_output_tokens for r in reqs), time.perf_counter()
    for _ in range(new_tokens):
        eng.step()
    wall = time.perf_counter() - t0
    tokens = sum(r.num_output_tokens for r in reqs) - done
    if tokens != batch * new_tokens:
        raise RuntimeError(f"{tokens} tokens in {new_tokens} steps of {batch} requests")
    for r in reqs:
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return tokens / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "int8"])
    # long enough that every request is still decoding when the last one is admitted
    ap.add_argument("--output-tokens", type=int, default=512)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--long-batch", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict = {}
    if args.decode:  # alternating rounds: contention hits both dtypes alike
        cases = [("batch 32, 128-token prompts", 32, 128),
                 (f"batch {args.long_batch}, {args.context}-token prompts", args.long_batch,
                  args.context - args.decode_tokens - 1)]
        for name, batch, plen in cases:
            for r in range(args.rounds):
                for kv in args.kv_cache_dtype:
                    rate = decode_rate(kv, batch, plen, args.decode_tokens)
                    out.setdefault(name, {}).setdefault(kv, []).append(round(rate, 1))
                    print(f"{name}, {kv}, round {r}: {rate:.1f} tok/s", flush=True)
    else:
        out = {kv: capacity_run(args, kv) for kv in args.kv_cache_dtype}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if args.decode or all(r["all_finished"] for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
