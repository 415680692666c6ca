"""Sampler overhead at batch 64 on the real model: decode step time with a mix of sampling
parameters vs all-greedy at the same batch, and the bounded (top-k <= 1024) vs the
full-vocabulary candidate path. Medians over --steps decode steps.

    python benchmarks/sampler_overhead.py [--batch 64] [--steps 20] [--device cpu|cuda]
        [--model DIR] [--json out.json]

Mixes (docs/architecture.md, Sampling; issue 3): half top-p 0.9 + top-k 50, a quarter seeded (same filter,
seed set), a quarter greedy. "seeded-temp" makes the seeded quarter temperature-only, which
hashes the whole vocabulary for those rows. "full-path" gives one filtering row top_k=2000,
so every filtering row goes through the sorted vocabulary. "nucleus" is every row at T=1,
top-p 0.95 (the OpenAI default-like chat setting): nuclei past 1,024 candidates. "T=1, no
seed" is the OpenAI API's defaults (temperature 1, top_p 1, no seed); "half greedy" puts
plain greedy rows beside them (their tokens from the LM head's argmaxes: a SPLIT HeadOutput).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from swaserve import LLM, SamplingParams


def mixes(b: int) -> dict[str, list[SamplingParams]]:
    greedy = [SamplingParams(temperature=0, max_tokens=10**4, ignore_eos=True) for _ in range(b)]
    filt = lambda **kw: SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=10**4,  # noqa: E731
                                       ignore_eos=True, **kw)
    half, quarter = b // 2, b // 4
    mixed = ([filt() for _ in range(half)] + [filt(seed=1000 + i) for i in range(quarter)]
             + greedy[: b - half - quarter])
    seeded_temp = ([filt() for _ in range(half)]
                   + [SamplingParams(temperature=0.8, seed=2000 + i, max_tokens=10**4, ignore_eos=True)
                      for i in range(quarter)] + greedy[: b - half - quarter])
    full = list(mixed)
    full[0] = SamplingParams(temperature=0.8, top_k=2000, top_p=0.9, max_tokens=10**4, ignore_eos=True)
    nucleus = [SamplingParams(temperature=1.0, top_p=0.95, seed=3000 + i, max_tokens=10**4,
                              ignore_eos=True) for i in range(b)]
    # the OpenAI API's defaults: temperature 1, top_p 1, no seed
    default = [SamplingParams(temperature=1.0, max_tokens=10**4, ignore_eos=True)
               for _ in range(b)]
    half_greedy = [default[i] if i % 2 else greedy[i] for i in range(b)]
    return {"all-greedy": greedy, "mixed (bounded path)": mixed, "mixed, seeded-temp": seeded_temp,
            "mixed (full path)": full, "nucleus (T=1, top-p .95)": nucleus,
            "T=1, no seed": default, "half greedy, half T=1": half_greedy}


def run(llm: LLM, params: list[SamplingParams], steps: int, prompts) -> tuple[float, float]:
    eng = llm.engine
    reqs = [eng.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
    while any(r.num_output_tokens == 0 for r in reqs):  # prefill everything first
        eng.step()
    step_t, sample_t = [], []
    for _ in range(steps):
        eng.step()
        step_t.append(eng.last_step.seconds)
        sample_t.append(eng.last_step.sample_seconds)
    for r in reqs:
        eng.abort(r.request_id)
        eng.release(r.request_id)
    eng.settle()
    return statistics.median(step_t), statistics.median(sample_t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--model", default=None, help="GGUF or HF-style directory (default: bundled)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_running_requests=args.batch, kv_memory="2GiB",
              max_model_len=1024, prefix_cache=False, device=args.device)
    ids = llm.tokenizer.encode(Path(argparse.__file__).read_text())[1:]
    prompts = [[2] + ids[i * 31:i * 31 + 63] for i in range(args.batch)]
    results = {}
    for name, params in mixes(args.batch).items():
        print(f"[sampler] {name} ...", file=sys.stderr, flush=True)
        results[name] = run(llm, params, args.steps, prompts)
    base_step, base_sample = results["all-greedy"]
    print(f"{'mix':26}{'step ms':>10}{'sampler ms':>12}{'overhead vs greedy':>20}")
    for name, (step, sample) in results.items():
        print(f"{name:26}{step * 1e3:10.1f}{sample * 1e3:12.1f}{(step - base_step) / base_step:19.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {"step_s": v[0], "sampler_s": v[1]}
                                               for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
