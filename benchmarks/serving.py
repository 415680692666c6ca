"""Serving benchmark: N streaming requests at concurrency C against any OpenAI-compatible
/v1/completions endpoint; prompts of a fixed token length from varied text, fixed output
length (ignore_eos). Reports output tok/s, req/s, TTFT and inter-token latency percentiles.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --model M \
        --concurrency 1 8 32 --num-requests 64 --prompt-tokens 128 --output-tokens 128 [--json f]

The prompt text is cut to `--prompt-tokens` by the bundled model's tokenizer, so every
server sees identical prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def build_prompts(n: int, tokens: int) -> list[str]:
    from tokenizers import Tokenizer

    from swaserve.checkpoint.source import resolve_model

    src = resolve_model(None)
    tk = Tokenizer.from_file(str(src.cache_dir() / "tokenizer" / "tokenizer.json"))
    import asyncio as _a
    import email
    import json as _j
    import logging

    text = "\n".join((m.__doc__ or "") + Path(m.__file__).read_text()[:20000]
                     for m in (argparse, _a, email, _j, logging))
    ids = tk.encode(text, add_special_tokens=False).ids
    out = []
    for i in range(n):
        start = (i * 97) % max(1, len(ids) - tokens)
        # the server adds <bos>: tokens - 1 of text
        out.append(tk.decode(ids[start:start + tokens - 1]))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, out_tokens: int,
              api_key: str | None, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": temperature,
            "top_p": top_p, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with client.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("text"):
                times.append(time.perf_counter())
    n = usage["completion_tokens"] if usage else len(times)
    return {"ttft": times[0] - t0 if times else float("nan"),
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": n,
            "latency": time.perf_counter() - t0}


async def run_level(args, prompts: list[str], concurrency: int) -> dict:
    url = args.base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(concurrency)
    # a fresh connection per request: llama-server drops idle keep-alive connections
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def task(p):
            async with sem:
                return await one(client, url, args.model, p, args.output_tokens, args.api_key,
                                 args.temperature, args.top_p)
        await task(prompts[0])  # warm-up
        t0 = time.perf_counter()
        n = args.num_requests or max(8, 2 * concurrency)
        res = await asyncio.gather(*[task(prompts[i % len(prompts)]) for i in range(n)])
        wall = time.perf_counter() - t0
    itl = [x for r in res for x in r["itl"]]
    ttft = [r["ttft"] for r in res]
    toks = sum(r["tokens"] for r in res)
    return {"concurrency": concurrency, "requests": len(res), "wall_s": wall,
            "output_tok_s": toks / wall, "req_s": len(res) / wall,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
            "ttft_p99": percentile(ttft, 0.99), "itl_p50": percentile(itl, 0.5),
            "itl_p90": percentile(itl, 0.9), "itl_p99": percentile(itl, 0.99),
            "median_latency_s": statistics.median(r["latency"] for r in res)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; e.g. 1 for the OpenAI API's default sampling (no seed)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling, e.g. 0.95 beside --temperature 1 (a chat default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = build_prompts(args.num_requests or 2 * max(args.concurrency + [4]), args.prompt_tokens)
    rows = []
    for c in args.concurrency:
        print(f"[bench] concurrency {c} ...", file=sys.stderr, flush=True)
        rows.append(asyncio.run(run_level(args, prompts, c)))
    cols = ["concurrency", "requests", "output_tok_s", "req_s", "ttft_p50", "ttft_p90", "ttft_p99",
            "itl_p50", "itl_p90", "itl_p99"]
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
