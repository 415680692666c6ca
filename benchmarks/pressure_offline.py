"""Memory pressure offline: 16 requests of ~3,000-token prompts and 64 greedy new tokens,
all added at once, on a KV budget that holds two of them (4 rows, 100 MiB): the worst case
for retraction. Prints finished requests, steps, wall time, retractions in total and per
request (max). Run it with PYTHONPATH=<other checkout> from outside this one to compare.

    python benchmarks/pressure_offline.py [--kv-memory 100MiB] [--rows 4] [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from swaserve import LLM, SamplingParams

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-memory", default="100MiB")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    llm = LLM(kv_memory=args.kv_memory, max_model_len=4096, max_running_requests=args.rows)
    eng = llm.engine
    prompts = [" ".join(random.Random(i).choice(WORDS) for _ in range(2900))
               for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reqs = [eng.add_request(p, params)[0] for p in prompts]
    t0, steps = time.monotonic(), 0
    while eng.has_unfinished() and time.monotonic() - t0 < args.timeout:
        eng.step()
        steps += 1
    print(json.dumps({"finished": sum(r.is_finished for r in reqs), "requests": len(reqs),
                      "steps": steps, "wall_s": round(time.monotonic() - t0, 1),
                      "retractions": eng.scheduler.num_preemptions,
                      "retractions_per_request_max": max(r.num_preemptions for r in reqs)}))


if __name__ == "__main__":
    main()
