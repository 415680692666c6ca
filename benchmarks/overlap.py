"""Overlap scheduling and grammar masking on the real model, batch 32.

1. Decode wall time per output token with overlap on vs off (alternating runs, medians):
   32 prompts of 128 tokens, all prefilled first, then --new-tokens greedy tokens each.
   Also the engine thread's own work per step (schedule + prepare + postprocess) measured
   without overlap: that is what overlap can hide, so it bounds the gain.
2. Per-step cost of grammar masking: the same batch with 8 rows constrained by a JSON
   schema (a long string keeps them open) vs none, overlap on.

    python benchmarks/overlap.py [--repeats 3] [--new-tokens 64] [--device cuda] [--model DIR]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from swaserve import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def decode_run(llm: LLM, prompts, params: list[SamplingParams]) -> dict:
    """Prefill everything, then time the decode steps: wall per output token, median step
    time and the engine thread's own work per step."""
    eng = llm.engine
    host: list[float] = []
    launch, post = eng.loop._launch, eng.post.run

    def timed(fn):
        def inner(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                host.append(time.perf_counter() - t)
        return inner

    eng.loop._launch, eng.post.run = timed(launch), timed(post)
    reqs = [eng.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    host.clear()
    start_tokens = sum(r.num_output_tokens for r in reqs)
    steps, own = [], []
    t0 = time.perf_counter()
    while any(not r.is_finished for r in reqs):
        eng.step()
        st = eng.last_step
        steps.append(st.seconds)
        own.append(st.seconds - st.forward_seconds - st.sample_seconds)
    wall = time.perf_counter() - t0
    tokens = sum(r.num_output_tokens for r in reqs) - start_tokens
    eng.settle()
    for r in reqs:
        eng.release(r.request_id)
    eng.loop._launch, eng.post.run = launch, post
    # the engine thread's own work: without overlap, what the step spends outside the
    # forward and the sampler; with it, the time spent scheduling, preparing, postprocessing
    busy = (sum(host) / max(1, len(steps)) if eng.overlap else statistics.median(own))
    return {"ms_per_token": wall / tokens * 1e3, "step_ms": statistics.median(steps) * 1e3,
            "host_ms_per_step": busy * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--grammar-rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (where overlap is meant to pay)")
    ap.add_argument("--model", default=None, help="GGUF or HF-style directory (default: bundled)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llms = {}
    for overlap in (True, False):
        log(f"[overlap] loading (overlap={overlap})")
        llms[overlap] = LLM(model=args.model, max_running_requests=args.batch,
                            prefix_cache=False, overlap=overlap, device=args.device)
    tok = llms[True].tokenizer
    ids = tok.encode(Path(argparse.__file__).read_text())[1:]
    prompts = [[2] + ids[i * 37:i * 37 + 127] for i in range(args.batch)]
    free = [SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            for _ in prompts]
    for llm in llms.values():  # warm-up
        decode_run(llm, prompts[:4], free[:4])
    runs: dict[str, list[dict]] = {"overlap on": [], "overlap off": []}
    for i in range(args.repeats):
        for overlap in ((True, False) if i % 2 == 0 else (False, True)):  # no order bias
            log(f"[overlap] repeat {i + 1}/{args.repeats}, overlap={overlap}")
            runs["overlap on" if overlap else "overlap off"].append(
                decode_run(llms[overlap], prompts, free))
    grammar = list(free)
    for j in range(args.grammar_rows):
        grammar[j * (args.batch // args.grammar_rows)] = SamplingParams(
            temperature=0, max_tokens=args.new_tokens, ignore_eos=True, json_schema=SCHEMA)
    llms[True].engine.compile_grammar(grammar[0])  # token table + compile, not timed
    runs["grammar, overlap on"], runs["free, overlap on"] = [], []
    for i in range(args.repeats):
        log(f"[grammar] repeat {i + 1}/{args.repeats}")
        for name in (("grammar", "free") if i % 2 == 0 else ("free", "grammar")):
            runs[f"{name}, overlap on"].append(
                decode_run(llms[True], prompts, grammar if name == "grammar" else free))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(f"batch {args.batch}, {args.new_tokens} new tokens, medians of {args.repeats}")
    print(f"{'run':24}{'ms/token':>10}{'step ms':>10}{'host ms/step':>14}")
    for k, v in med.items():
        print(f"{k:24}{v['ms_per_token']:10.2f}{v['step_ms']:10.1f}{v['host_ms_per_step']:14.2f}")
    on, off = med["overlap on"], med["overlap off"]
    # each repeat measures on and off back to back: the ratio within a pair is steadier
    # than the ratio of medians on a machine whose speed drifts
    pairs = statistics.median(a["ms_per_token"] / b["ms_per_token"]
                              for a, b in zip(runs["overlap on"], runs["overlap off"]))
    print(f"overlap: {1 - pairs:+.1%} wall per output token (median on/off ratio of paired "
          f"runs {pairs:.3f}; of medians {on['ms_per_token'] / off['ms_per_token']:.3f}); "
          f"engine-thread work without "
          f"overlap {off['host_ms_per_step']:.2f} ms of a {off['step_ms']:.1f} ms step "
          f"({off['host_ms_per_step'] / off['step_ms']:.1%}, the most overlap can hide)")
    g, f = med["grammar, overlap on"], med["free, overlap on"]
    print(f"grammar masking: {args.grammar_rows} of {args.batch} rows, +{g['step_ms'] - f['step_ms']:.1f} ms "
          f"per step ({(g['step_ms'] - f['step_ms']) / args.grammar_rows:.2f} ms per grammar row "
          f"per token, {g['step_ms'] / f['step_ms'] - 1:+.1%} step time)")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
