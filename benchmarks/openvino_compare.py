"""swaserve against OpenVINO GenAI (int8 IR) on the same token ids, alternating in one run:
prefill of a 512-token prompt, greedy decode at batch 1, 8 and 32 (128-token prompts,
prefill excluded). Prints each pair, the medians and the ratios swaserve / OpenVINO.

    python benchmarks/openvino_compare.py [--pairs 3] [--repeats 3] [--new-tokens 128]
        [--peer ~/.cache/swaserve-peers/openvino] [--swaserve-only]

The peer is the shared harness (`../shared/peers/openvino`: `setup.sh` builds its venv and
IR, `bench.py` runs it on given ids); both sides measure alike: prefill = 512 / the wall
time of a 1-token request, decode = b * (N - 1) / (t(N tokens) - t(1 token)) on the same
b prompts, medians of `--repeats` after one warm-up, 2 threads, no prefix caching.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

KINDS = ("pp512", "tg1", "tg8", "tg32")
# the shared harness: ../shared/peers/openvino of the checkout (or of a folder above it)
HARNESS = next((p / "shared" / "peers" / "openvino" for p in Path(__file__).resolve().parents
                if (p / "shared" / "peers" / "openvino" / "bench.py").exists()),
               Path("../shared/peers/openvino"))


def log(msg: str) -> None:
    print(msg, flush=True)


def workload(encode) -> dict:
    """The ids both engines run: a 512-token prompt and 32 prompts of 128 tokens, from
    deterministic English and code."""
    ids = encode(Path(argparse.__file__).read_text())[1:]
    return {"prefill": [2] + ids[5000:5511],
            "rows": [[2] + ids[i * 37:i * 37 + 127] for i in range(32)]}


class Swaserve:
    """The default engine a user gets (LLM), prefix cache off, 32 rows."""

    def __init__(self, new_tokens: int):
        from swaserve import LLM

        self.llm = LLM(max_running_requests=32, prefix_cache=False)
        self.n = new_tokens

    def _generate(self, prompts: list[list[int]], n: int) -> float:
        from swaserve import SamplingParams

        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True))
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == n for o in outs)
        return dt

    def run(self, ids: dict, repeats: int) -> dict[str, float]:
        """tok/s per kind, as bench.py measures them (medians of `repeats`)."""
        self._generate([ids["prefill"]], 1)  # warm-ups
        self._generate(ids["rows"][:2], self.n)
        out = {}
        for kind in KINDS:
            vals = []
            for _ in range(repeats):
                if kind == "pp512":
                    vals.append(len(ids["prefill"]) / self._generate([ids["prefill"]], 1))
                    continue
                b = int(kind[2:])
                rows = ids["rows"][:b]
                t1 = self._generate(rows, 1)
                vals.append(b * (self.n - 1) / (self._generate(rows, self.n) - t1))
            out[kind] = statistics.median(vals)
        return out


def openvino(peer: Path, ids_path: str, repeats: int, new_tokens: int) -> dict[str, float]:
    env = dict(os.environ, NEW_TOKENS=str(new_tokens), OV_THREADS="2")
    res = subprocess.run([str(peer / "venv/bin/python"), str(HARNESS / "bench.py"),
                          str(peer / "ir-int8"), ids_path, str(repeats)],
                         capture_output=True, text=True, env=env, check=True)
    return {k: v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()
            if k in KINDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peer", type=Path,
                    default=Path.home() / ".cache" / "swaserve-peers" / "openvino")
    ap.add_argument("--swaserve-only", action="store_true")
    args = ap.parse_args()

    sw = Swaserve(args.new_tokens)
    ids = workload(sw.llm.tokenizer.encode)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    peer = not args.swaserve_only and (args.peer / "venv/bin/python").exists() and (
        args.peer / "ir-int8").exists()
    if not peer and not args.swaserve_only:
        log(f"no OpenVINO harness at {args.peer} (run {HARNESS / 'setup.sh'}): swaserve only")
    runs = {"swaserve": [], "openvino": []}
    for pair in range(args.pairs):
        order = ["swaserve", "openvino"] if pair % 2 == 0 else ["openvino", "swaserve"]
        for name in order:
            if name == "swaserve":
                runs[name].append(sw.run(ids, args.repeats))
            elif peer:
                runs[name].append(openvino(args.peer, f.name, args.repeats, args.new_tokens))
            else:
                continue
            log(f"pair {pair + 1} {name}: " + ", ".join(
                f"{k} {runs[name][-1][k]:,.1f}" for k in KINDS))
    os.unlink(f.name)
    log("\ntok/s, medians of pairs; ratio = median of the paired ratios swaserve / OpenVINO")
    log("kind  | swaserve | OpenVINO int8 | ratio (pairs)")
    for k in KINDS:
        s = statistics.median(r[k] for r in runs["swaserve"])
        if not runs["openvino"]:
            log(f"{k:5s} | {s:8,.1f} |")
            continue
        o = statistics.median(r[k] for r in runs["openvino"])
        ratios = [a[k] / b[k] for a, b in zip(runs["swaserve"], runs["openvino"])]
        log(f"{k:5s} | {s:8,.1f} | {o:13,.1f} | {statistics.median(ratios):.2f} "
            f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
