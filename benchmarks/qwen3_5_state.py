"""Qwen3.5's recurrent state: capacity, prefix hits through state checkpoints, their memory.

1. `swaserve plan` capacity of a budget for Qwen3.5-0.8B- and -27B-shaped configs (config
   only, no weights): the Gated DeltaNet layers' state per request row against what
   token-scaled and full-history accounting would reserve for them.
2. Prefix-hit TTFT, warm vs cold, on a small random Qwen3.5 model (transformers' class,
   float32): a request sharing a prompt's first 1,024 tokens (a checkpoint) and a request
   sharing 1,536 (between checkpoints: it backs off to 1,024 and recomputes the rest), the
   same prompt again (the checkpoint at its last page boundary). Cold = the same engine
   without the prefix cache. The greedy outputs must be identical.
3. Checkpoint memory per cached token: a checkpoint's bytes over the checkpoint interval,
   beside the full layers' KV per token, for the small model and the shaped configs.

    python benchmarks/qwen3_5_state.py [--device cpu|cuda] [--repeats 3] [--json f]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.models.test_qwen3_5 import QWEN35_08B, QWEN35_27B  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def capacity(tmp: Path) -> dict:
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    out = {}
    for name, cfg, budget in (("0.8B", QWEN35_08B, "8GiB"), ("27B", QWEN35_27B, "32GiB")):
        d = tmp / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        rep = plan_report(EngineConfig(model=str(d), kv_memory=budget, dtype="bf16"),
                          context=32768)
        acc, rec = rep["accounting"], rep["recurrent"]
        out[name] = {
            "budget": budget, "state_mib_per_request": rec["state_bytes_per_request"] / 2**20,
            "full_kv_bytes_per_token": acc["ring"]["bytes_per_token"],
            "history_bytes_per_token": rec["history_bytes_per_token"],
            "requests_32k": {k: acc[k]["max_concurrent_requests"] for k in acc},
            "checkpoint_bytes_per_cached_token_1024": rec["state_bytes_per_request"] / 1024,
        }
        log(f"[plan] {name}: {out[name]}")
    return out


def ttft(device: str, repeats: int, tmp: Path) -> dict:
    import torch

    from swaserve import SamplingParams
    from swaserve.engine.engine import Engine
    from tests.helpers.checkpoints import write_tiny_qwen3_5

    path, _ = write_tiny_qwen3_5(tmp / "small", hidden_size=256, intermediate_size=512,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                 linear_num_key_heads=4, linear_num_value_heads=8,
                                 linear_key_head_dim=32, linear_value_head_dim=32,
                                 max_position_embeddings=8192, vocab_size=1024)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 1024, (2048,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cases = {"at_checkpoint": 1024, "between_checkpoints": 1536, "same_prompt": 2048}
    res: dict = {"model": "hidden 256, 8 layers (6 GDN), float32", "device": device}
    tails = {(name, r): torch.randint(3, 1024, (512,), generator=g).tolist()
             for name in cases for r in range(repeats)}
    outs: dict = {}
    for cache in (True, False):
        eng = Engine(model=path, dtype="float32", device=device, kv_memory="1GiB",
                     max_running_requests=4, chunk_size=512, prefix_cache=cache)
        for name, shared in cases.items():
            times = []
            for r in range(repeats):
                prompt = base if name == "same_prompt" else None
                if prompt is None:
                    tail = tails[(name, r)]
                    first, prompt = base[:shared] + tail[:256], base[:shared] + tail[256:512]
                    eng.add_request(first, params)
                else:
                    eng.add_request(base, params)
                while eng.has_unfinished():
                    eng.step()
                req = eng.add_request(prompt, params)[0]
                t0 = time.perf_counter()
                while req.num_output_tokens == 0:
                    eng.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                while eng.has_unfinished():
                    eng.step()
                outs.setdefault((name, r, len(prompt)), []).append(list(req.output_token_ids))
                log(f"[ttft] cache={cache} {name} run {r}: {times[-1] * 1e3:.1f} ms, cached "
                    f"{req.num_cached_tokens} of {len(prompt)}")
            res.setdefault(name, {})["warm_ms" if cache else "cold_ms"] = (
                statistics.median(times) * 1e3)
            if cache:
                res[name]["cached_tokens"] = req.num_cached_tokens
        if cache:
            plan = eng.plan
            res["checkpoint_bytes"] = plan.state_slot_bytes
            res["full_kv_bytes_per_token"] = plan.full_bytes_per_token
            res["checkpoint_bytes_per_cached_token_1024"] = plan.state_slot_bytes / 1024
    res["outputs_identical"] = all(len(v) == 2 and v[0] == v[1] for v in outs.values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        res = {"capacity": capacity(tmp), "prefix_ttft": ttft(args.device, args.repeats, tmp)}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
