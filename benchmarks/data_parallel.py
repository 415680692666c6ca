"""Data-parallel replicas and prefix-affinity routing, side by side on the bundled model:

    (a) one engine (`swaserve serve`, all cores)
    (b) 2 replicas, round-robin routing  (`--data-parallel-size 2 --routing round-robin`)
    (c) 2 replicas, prefix-affinity routing (`--data-parallel-size 2`, the default)

through two workloads, each request streamed by the chat route:

    chat:    C conversations x T turns at once, each turn the whole history so far (user
             turns of ~60 words, the assistant's own replies) plus a new user turn
    system:  S system prompts of ~W words, Q questions each, shuffled, at concurrency 16

Reports the prefix hit rate (cached prompt tokens / prompt tokens, from the usage the server
returns), total time, TTFT p50/p99 and output tok/s.

    python benchmarks/data_parallel.py [--conversations 16 --turns 6] [--json out.json]

On a machine with fewer cores than replicas x threads, the replicas share the cores: hit
rate and TTFT are the figures to read; throughput there shows the cost of sharing, not what
separate machines would give.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from serving import percentile  # benchmarks/serving.py, beside this script

WORDS = ("river stone cloud paper garden window music field light harbor forest engine "
         "letter market bridge winter silver yellow morning quiet bottle candle orange "
         "planet village mirror ladder basket rocket shadow thunder").split()


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


class Server:
    """`swaserve serve ARGS` on a free port, its output in a file (Ray's logs are many)."""

    def __init__(self, args: list[str], label: str):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"dp-{label}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swaserve", "serve", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "SWASERVE_NO_PROGRESS": "1"})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited:\n{self.log.read()[-3000:]}")
            try:
                r = httpx.post(self.url + "/v1/chat/completions", timeout=30, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"no answer within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
               out: list[dict]) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    out.append({"ttft": ttft if ttft is not None else time.perf_counter() - t0,
                "prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"]})
    return "".join(text)


async def chat_workload(url: str, conversations: int, turns: int, max_tokens: int,
                        seed: int) -> list[dict]:
    out: list[dict] = []

    async def conversation(client, c):
        rnd = random.Random(seed * 1000 + c)
        messages = [{"role": "user", "content": f"Conversation {c}. " + words(rnd, 60)}]
        for _ in range(turns):
            reply = await chat(client, url, messages, max_tokens, out)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": words(rnd, 60)}]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(conversation(client, c) for c in range(conversations)))
    return out


async def system_workload(url: str, systems: int, questions: int, system_words: int,
                          max_tokens: int, seed: int, concurrency: int = 16) -> list[dict]:
    rnd = random.Random(seed)
    prompts = [f"You are assistant number {s}. " + words(rnd, system_words)
               for s in range(systems)]
    jobs = [(s, words(rnd, 20)) for s in range(systems) for _ in range(questions)]
    rnd.shuffle(jobs)
    out: list[dict] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(client, s, q):
        async with gate:
            await chat(client, url, [{"role": "system", "content": prompts[s]},
                                     {"role": "user", "content": q}], max_tokens, out)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, s, q) for s, q in jobs))
    return out


def summarize(rows: list[dict], seconds: float) -> dict:
    ttfts = [r["ttft"] for r in rows]
    return {"requests": len(rows),
            "hit_rate": sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)),
            "seconds": seconds, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": percentile(ttfts, 0.99),
            "output_tok_s": sum(r["completion"] for r in rows) / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", default=["one", "round-robin", "prefix"],
                    choices=["one", "round-robin", "prefix"])
    ap.add_argument("--workloads", nargs="+", default=["chat", "system"],
                    choices=["chat", "system"])
    ap.add_argument("--concurrency", type=int, default=16, help="of the system workload")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    launch = {"one": ["--num-threads", str(cores)],
              "round-robin": ["--data-parallel-size", "2", "--routing", "round-robin"],
              "prefix": ["--data-parallel-size", "2", "--routing", "prefix"]}
    results = {}
    for name in args.configs:
        server = Server(launch[name], name)
        try:
            up = server.wait()
            print(f"[{name}] up in {up:.1f} s", flush=True)
            for workload in args.workloads:
                t0 = time.monotonic()
                if workload == "chat":
                    rows = asyncio.run(chat_workload(server.url, args.conversations, args.turns,
                                                     args.max_tokens, args.seed))
                else:
                    rows = asyncio.run(system_workload(server.url, args.systems, args.questions,
                                                       args.system_words, args.max_tokens,
                                                       args.seed, args.concurrency))
                s = summarize(rows, time.monotonic() - t0)
                results[(name, workload)] = s
                print(f"[{name}] {workload}: {s['requests']} requests, hit rate "
                      f"{100 * s['hit_rate']:.1f} %, {s['seconds']:.1f} s, TTFT p50 "
                      f"{1000 * s['ttft_p50']:.0f} ms p99 {1000 * s['ttft_p99']:.0f} ms, "
                      f"{s['output_tok_s']:.1f} output tok/s", flush=True)
        finally:
            server.stop()
    print("\n| workload | routing | requests | hit rate | total s | TTFT p50 ms | TTFT p99 ms "
          "| output tok/s |\n|---|---|---|---|---|---|---|---|")
    labels = {"one": "one engine", "round-robin": "2 replicas, round robin",
              "prefix": "2 replicas, prefix affinity"}
    for (name, workload), s in sorted(results.items(), key=lambda kv: kv[0][1]):
        print(f"| {workload} | {labels[name]} | {s['requests']} | {100 * s['hit_rate']:.1f} % | "
              f"{s['seconds']:.1f} | {1000 * s['ttft_p50']:.0f} | {1000 * s['ttft_p99']:.0f} | "
              f"{s['output_tok_s']:.1f} |")
    for workload in ("chat", "system"):
        if all((c, workload) in results for c in ("one", "round-robin", "prefix")):
            one, rr, pf = (results[(c, workload)]["hit_rate"] for c in
                           ("one", "round-robin", "prefix"))
            print(f"{workload}: prefix affinity is {100 * (one - pf):.1f} points below one "
                  f"engine and {100 * (pf - rr):.1f} above round robin")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f"{k[0]}/{k[1]}": v for k, v in results.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
