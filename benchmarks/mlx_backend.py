"""MLX backend vs torch backend on the same model and machine: median decode step time at
batch 1 and 8 and a 128-token prefill, engines alternating (`--repeats` rounds). Each
backend as it runs by default (torch: int8 copies of the GGUF's blocks; MLX: its quantized
matmul on the Q8_0 / Q5_0 / Q4_K weights), and MLX with every weight dequantized. On Linux
this is MLX's CPU build; on Apple silicon it is Metal.

    python benchmarks/mlx_backend.py [--model PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from swaserve.engine.engine import Engine
from swaserve.sampling.params import SamplingParams


def _time(eng: Engine, batch: int, prompt: int, new: int) -> float:
    """Seconds per step of `batch` requests of `prompt` tokens decoding `new` tokens
    (new = 1: the prefill step alone)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i in range(batch):
        eng.add_request([2] + [100 + (i * 7 + j) % 5000 for j in range(prompt - 1)], params)
    eng.step()  # the prefill
    if new == 1:
        prefill = eng.last_step.seconds
        while eng.has_unfinished():
            eng.step()
        return prefill
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return (time.perf_counter() - t) / max(1, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engines = {name: Engine(model=args.model, device=d, prefix_cache=False, int8_weights=q)
               for name, d, q in (("torch", "cpu", True), ("mlx", "mlx", True),
                                  ("mlx dense", "mlx", False))}
    cases = {"decode b1": (1, 16, 9), "decode b8": (8, 16, 9), "prefill 128": (1, 128, 1)}
    got = {(c, d): [] for c in cases for d in engines}
    for r in range(args.repeats):
        for c, (b, p, n) in cases.items():
            for d, eng in engines.items():
                got[c, d].append(_time(eng, b, p, n) * 1000)
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    names = list(engines)
    print(f"{'case':<12}" + "".join(f"{n + ' ms':>14}" for n in names)
          + "".join(f"{n + ' / torch':>18}" for n in names[1:]))
    for c in cases:
        ms = [statistics.median(got[c, n]) for n in names]
        print(f"{c:<12}" + "".join(f"{m:14.1f}" for m in ms)
              + "".join(f"{m / ms[0]:18.1f}" for m in ms[1:]))


if __name__ == "__main__":
    main()
