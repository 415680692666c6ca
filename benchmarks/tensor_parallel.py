"""Tensor parallelism's cost on one machine: the bundled model's decode step (batch 1 and 8)
and a 512-token prefill at tensor_parallel_size 1 and 2, greedy, same prompts; tp = 1 both
with its int8 decode kernels (the default) and without them (the bf16 products tp = 2
runs, so that the difference is the collectives and the split). Medians of decode steps.

    python benchmarks/tensor_parallel.py [--sizes 1 2] [--tokens 32]

On one 2-core machine tp = 2 cannot be faster: the two ranks share the cores that one
process would use, and every layer adds two all-reduces over loopback. The figure is the
price of the collectives, which a model too big for one device pays to run at all.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from swaserve.engine.engine import Engine
from swaserve.sampling.params import SamplingParams


def measure(tp: int, int8: bool, tokens: int) -> dict:
    eng = Engine(tensor_parallel_size=tp, int8_weights=int8, kv_memory="256MiB",
                 max_model_len=2048)
    try:
        ids = eng.tokenize("The capital of France is")
        out = {}
        for batch in (1, 8):
            for n in (4, tokens):  # the first run warms up
                reqs = [eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True))[0]
                        for _ in range(batch)]
                while any(r.num_output_tokens == 0 for r in reqs):
                    eng.step()
                steps = []
                while eng.has_unfinished():
                    t0 = time.perf_counter()
                    eng.step()
                    steps.append(time.perf_counter() - t0)
            out[f"decode b{batch} ms"] = 1000 * statistics.median(steps)
            out[f"tokens b{batch}"] = reqs[0].output_token_ids
        t0 = time.perf_counter()
        eng.add_request(list(range(2, 514)), SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        out["prefill 512 ms"] = 1000 * (time.perf_counter() - t0)
        return out
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    runs = []
    for tp in args.sizes:
        for int8 in ((True, False) if tp == 1 else (False,)):
            label = f"tp={tp}" + (", int8 decode" if int8 else ", bf16")
            print(f"[tp] {label} ...", file=sys.stderr, flush=True)
            runs.append((label, measure(tp, int8, args.tokens)))
    keys = ["decode b1 ms", "decode b8 ms", "prefill 512 ms"]
    print("| setting | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for label, r in runs:
        print(f"| {label} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    ref = dict(runs)
    bf16 = ref.get("tp=1, bf16")
    for label, r in runs:  # bf16 sums split over ranks round differently: say where it shows
        if bf16 is not None and r is not bf16:
            a, b = r["tokens b1"], bf16["tokens b1"]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            print(f"{label}: greedy tokens equal tp=1 bf16's for the first {same} of {len(a)}")
    for label, r in runs:
        if bf16 is not None and label.startswith("tp=") and not label.startswith("tp=1"):
            print(f"{label} vs tp=1 bf16: " + ", ".join(
                f"{k} x{r[k] / bf16[k]:.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
