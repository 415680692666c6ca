"""The engine on the server's thread vs on the main thread: time between tokens of one greedy
request through `AsyncEngine` (the server's engine thread, no HTTP), with and without the
building thread's OpenMP workers given back (`release_openmp_workers`), against
`Engine.step` in a loop on the thread that built the engine. Runs alternate; medians.

    python benchmarks/engine_thread.py [--tokens 128] [--rounds 3]

libgomp lets a team's workers spin between parallel regions only while it manages no more
threads than there are cores: a second idle team (the main thread's, left by loading) makes
every region of the engine thread start with a futex wake.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt(k: int) -> list[int]:
    return [2] + [(13 * j + 7 * k) % 20000 + 300 for j in range(127)]


def offline(eng, params, k: int) -> float:
    """ms a decode step, Engine.step on this thread"""
    req = eng.add_request(prompt(k), params)[0]
    while not req.output_token_ids:
        eng.step()
    t0, n = time.perf_counter(), 0
    while not req.is_finished:
        eng.step()
        n += 1
    eng.release(req.request_id)
    return 1000 * (time.perf_counter() - t0) / n


def served(params, k: int, release: bool) -> float:
    """ms between tokens through an AsyncEngine over an engine built here, as the server
    does (loading runs parallel regions on this thread); without `release` its constructor
    keeps this thread's OpenMP team (the way it was before)"""
    from swaserve.server import async_engine

    real = async_engine.release_openmp_workers
    if not release:
        async_engine.release_openmp_workers = lambda: False
    try:
        aeng = async_engine.AsyncEngine(engine())
    finally:
        async_engine.release_openmp_workers = real

    async def run() -> list[float]:
        aeng.admit()
        stamps = []
        async for _ in aeng.generate(prompt(k), params, f"bench-{k}"):
            stamps.append(time.perf_counter())
        return stamps

    try:
        stamps = asyncio.run(run())
    finally:
        aeng.shutdown()
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the first decode on
    return 1000 * statistics.median(gaps)


def engine():
    from swaserve.engine.engine import Engine

    return Engine(max_running_requests=4, max_model_len=1024, kv_memory="1GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from swaserve.sampling.params import SamplingParams

    log("[engine_thread] loading the bundled model (once a run, as a server does)")
    eng = engine()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows: dict[str, list[float]] = {"Engine.step, main thread": [],
                                    "AsyncEngine, workers given back": [],
                                    "AsyncEngine, workers kept": []}
    for r in range(args.rounds):
        log(f"[engine_thread] round {r + 1} of {args.rounds}")
        rows["Engine.step, main thread"].append(offline(eng, params, 3 * r))
        rows["AsyncEngine, workers given back"].append(served(params, 3 * r + 1, True))
        rows["AsyncEngine, workers kept"].append(served(params, 3 * r + 2, False))
    base = statistics.median(rows["AsyncEngine, workers given back"])
    print(f"\n{torch.get_num_threads()} threads, batch 1, {args.tokens} tokens, "
          f"medians of {args.rounds} alternating rounds")
    print("| run | ms a token | vs workers given back |")
    print("|---|---|---|")
    for name, ms in rows.items():
        m = statistics.median(ms)
        print(f"| {name} | {m:.2f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
