"""Decode beside other work: batch-1 and batch-32 decode tok/s on a quiet machine, then
beside one busy process (a pure-Python loop, which takes one core), then quiet again, in
one run, for each setting given. Each setting runs in a fresh process, since OpenMP reads
its environment once, when torch loads it.

    python benchmarks/shared_cpu.py [--settings adaptive fixed passive] [--tokens 32]

adaptive: the engine's default (engine/threads.py: fewer threads while a core is taken).
fixed: SWASERVE_FIXED_THREADS=1 (as adaptive_threads=False), all threads always. one: one
thread always, the most a drop to one thread can keep beside a busy process (its quiet
speed). The others are fixed threads with an OpenMP waiting policy: passive
(OMP_WAIT_POLICY=PASSIVE, threads sleep at once), spinN (GOMP_SPINCOUNT=N; libgomp's
default spins ~0.3 s before sleeping).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

FIXED = {"SWASERVE_FIXED_THREADS": "1"}
THREADS_ENV = "SHARED_CPU_THREADS"  # the child's num_threads, where a setting fixes it
SETTINGS = {"adaptive": {}, "fixed": FIXED, "one": {**FIXED, THREADS_ENV: "1"},
            "passive": {**FIXED, "OMP_WAIT_POLICY": "PASSIVE"},
            "spin1k": {**FIXED, "GOMP_SPINCOUNT": "1000"},
            "spin10k": {**FIXED, "GOMP_SPINCOUNT": "10000"}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(tokens: int, repeats: int) -> None:
    """Runs inside one setting's process: prints JSON of tok/s per phase and batch."""
    from swaserve import LLM, SamplingParams

    llm = LLM(max_running_requests=32, prefix_cache=False,
              num_threads=int(os.environ.get(THREADS_ENV, 0)) or None)
    prompts = [[2] + [(31 * i + j) % 20000 + 300 for j in range(63)] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def rate(batch: int) -> float:
        runs = []
        for _ in range(repeats):
            llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=1))  # prefill
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], params)
            runs.append(batch * tokens / (time.perf_counter() - t0))
        return statistics.median(runs)

    rate(1)  # warm up
    out = {}
    for phase in ("quiet", "busy", "quiet again"):
        burner = None
        if phase == "busy":
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            out[phase] = {str(b): rate(b) for b in (1, 32)}
            gov = llm.engine.governor
            out[phase]["thread changes"] = gov.changes if gov is not None else 0
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=["adaptive", "fixed"],
                    choices=sorted(SETTINGS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.repeats)
        return
    results = {}
    for name in args.settings:
        log(f"[{name}] running")
        env = {k: v for k, v in os.environ.items() if k not in ("SWASERVE_FIXED_THREADS", THREADS_ENV)}
        env.update(SETTINGS[name], SWASERVE_NO_PROGRESS="1")
        r = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens),
                            "--repeats", str(args.repeats)], env=env, capture_output=True,
                           text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    for name, res in results.items():
        log(f"[{name}] thread changes by the end of each phase: "
            f"{[res[p]['thread changes'] for p in ('quiet', 'busy', 'quiet again')]}")
    print("| setting | batch | quiet tok/s | beside a busy process | quiet again | kept |")
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        for b in ("1", "32"):
            q, busy, q2 = (res[p][b] for p in ("quiet", "busy", "quiet again"))
            print(f"| {name} | {b} | {q:.1f} | {busy:.1f} | {q2:.1f} | "
                  f"{100 * busy / ((q + q2) / 2):.0f} % |")


if __name__ == "__main__":
    main()
