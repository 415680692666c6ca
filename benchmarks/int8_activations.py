"""The layers' products on int8 activations (`int8_activations`, q8_dpbusd) against bf16
activations (q8_dpbf16, or torch's bf16 past PROMPT_DPBF16_ROWS), alternating in one
engine (bundled Gemma 3 270M, bf16): greedy decode steps at each batch size and whole
prefills, medians, the ratio; then the products alone at the model's shapes.

    python benchmarks/int8_activations.py [--batches 32 128] [--prefill 512 2048] [--pairs 3]

Runs only where q8_dpbusd takes q8_dpbf16's place (AVX-512 VNNI and BF16, no AMX).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from roofline import decode_run, log, median_time, prefill_run  # noqa: E402


def set_int8(model, on: bool) -> None:
    """Every layer weight's `int8_activations` (what `use_q8` sets at load)."""
    for layer in model.layers:
        for w in layer.q8.values():
            w.int8_activations = on
    model._q8_tilings = None  # the speculative rows' cache of the weights' kernels


def products(model, rows: list[int]) -> None:
    """The four products of one layer at each row count, both ways, x 18 layers."""
    layer = model.layers[0]
    for m in rows:
        total = {False: 0.0, True: 0.0}
        for w in layer.q8.values():
            x = torch.randn(m, w.shape[1]).to(torch.bfloat16)
            out = torch.empty(m, w.shape[0], dtype=torch.bfloat16)
            for on in (False, True):
                kernel = "dpbusd" if on else "dpbf16"
                total[on] += median_time(
                    lambda w=w, x=x, out=out, kernel=kernel: w.matmul(x, out=out, kernel=kernel), 9)
        n = len(model.layers)
        log(f"products at {m} rows x {n} layers: bf16 activations {total[False] * n * 1e3:.1f} ms, "
            f"int8 {total[True] * n * 1e3:.1f} ms ({total[False] / total[True]:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()

    from swaserve.config import cache_root
    from swaserve.engine.engine import Engine
    from swaserve.kernels import build, q8

    build.use_cache_dir(cache_root() / "kernels")  # q8 is asked before the engine loads
    if q8.amx_available() or q8.tile_kernel(64, int8=True) != "dpbusd":
        log("q8_dpbusd does not take q8_dpbf16's place on this CPU (AMX, or no AVX-512 "
            "VNNI and BF16): nothing to compare")
        return
    # prompts in chunks of 512 (the default): the rings of 128 rows for 2,048-token
    # chunks would need 5 GB
    eng = Engine(dtype="bfloat16", prefix_cache=False, max_running_requests=max(args.batches),
                 max_model_len=4096, kv_memory="3GiB")
    model = eng.model
    products(model, [32, 128, 512])
    runs = [("decode", b) for b in args.batches] + [("prefill", n) for n in args.prefill]
    for kind, size in runs:
        times = {False: [], True: []}
        for pair in range(args.pairs):
            for on in ((False, True) if pair % 2 == 0 else (True, False)):
                set_int8(model, on)
                if kind == "decode":
                    t = decode_run(eng, size, args.steps, args.prompt_len, False)[0]
                else:
                    t = prefill_run(eng, size, 3, False)[0]
                times[on].append(t)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        log(f"{kind} {size}: bf16 activations {off * 1e3:.1f} ms ({size / off:,.0f} tok/s), "
            f"int8 {on * 1e3:.1f} ms ({size / on:,.0f} tok/s): {off / on:.2f}x  "
            f"[pairs: {', '.join(f'{a * 1e3:.1f}/{b * 1e3:.1f}' for a, b in zip(times[False], times[True]))}]")
    set_int8(model, False)


if __name__ == "__main__":
    main()
