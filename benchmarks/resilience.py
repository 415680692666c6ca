"""Resilience benchmark: what production traffic does to a live `swaserve serve`.

Three scenarios, each against a server this script starts on a free loopback port (the
bundled model unless --model):

  disconnects  N concurrent streams; a third of the clients leave abruptly after 1-3
               chunks (half with a clean close, half with a TCP reset); the rest must end
               with a finish_reason and [DONE]. Then: seconds until the gauges say idle,
               with no further request.
  pressure     16 concurrent streams with ~3,000-token prompts and max_tokens 64 on a KV
               budget that holds one or two of them: all must finish; retractions per
               request from the server's histogram.
  fuzz         the malformed requests of issue #15 and random mutations of valid bodies:
               no 5xx, every error in OpenAI's shape.

It prints, per scenario: completed / disconnected / rejected / failed, 5xx count, p50 and
p99 latency, truncated and hung streams, retractions per request (max), time to idle
gauges, and the server's RSS before and after.

    python benchmarks/resilience.py [--scenarios disconnects pressure fuzz] [--json out.json]
        [--pythonpath OTHER_CHECKOUT]   # run the server of another checkout (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: argparse.Namespace, *flags: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "SWASERVE_NO_PROGRESS": "1"}
        if args.pythonpath:
            env["PYTHONPATH"] = args.pythonpath
        cmd = [sys.executable, "-m", "swaserve", "serve", "--port", str(self.port), *flags]
        if args.model:
            cmd += ["--model", args.model]
        self.log = open(f"/tmp/swaserve-resilience-{self.port}.log", "w")  # noqa: SIM115
        # the working directory comes first on `python -m`'s path: run from the checkout
        cwd = args.pythonpath or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log.name).read())
        print(f"  server up in {time.monotonic() - t0:.1f} s: {' '.join(flags)}", flush=True)

    def rss_mb(self) -> float:
        if self.proc.poll() is not None:
            return float("nan")
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def seconds_to_idle(self, timeout: float = 60) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            m = self.metrics()
            if (m.get("swaserve_requests_running") == 0 and m.get("swaserve_requests_waiting") == 0
                    and m.get("swaserve_ring_rows_usage") == 0):
                return time.monotonic() - t0
            time.sleep(0.05)
        return float("inf")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.log.close()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def stream(base: str, body: dict, timeout: float) -> dict:
    """One streaming request read to its end: outcome, latency, whether it was whole."""
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return {"outcome": "rejected" if r.status_code < 500 or r.status_code == 503
                            else "failed", "status": r.status_code}
                events, done = [], False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
    except httpx.TimeoutException:
        return {"outcome": "hung", "status": None}
    last = events[-1] if events else {}
    if "error" in last:
        return {"outcome": "failed", "status": 200, "latency": time.monotonic() - t0}
    whole = done and bool(last.get("choices")) and last["choices"][0].get("finish_reason")
    return {"outcome": "completed" if whole else "truncated", "status": 200,
            "latency": time.monotonic() - t0}


async def leave_early(base: str, body: dict, chunks: int, reset: bool) -> dict:
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    seen = 0
    while seen < chunks:
        line = await asyncio.wait_for(reader.readline(), 120)
        if not line:
            break
        seen += line.startswith(b"data: ")
    if reset:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
    writer.close()
    return {"outcome": "disconnected", "status": 200}


def summarize(name: str, results: list[dict], server: Server, rss0: float, extra: dict) -> dict:
    lat = [r["latency"] for r in results if r.get("outcome") == "completed"]
    count = {k: sum(r["outcome"] == k for r in results)
             for k in ("completed", "disconnected", "rejected", "failed", "truncated", "hung")}
    row = {"scenario": name, **count,
           "5xx": sum(1 for r in results if (r.get("status") or 0) >= 500 and r["status"] != 503),
           "p50_s": round(pct(lat, 0.5), 2), "p99_s": round(pct(lat, 0.99), 2),
           "rss_mb_before": round(rss0, 1), "rss_mb_after": round(server.rss_mb(), 1), **extra}
    print("  " + json.dumps(row), flush=True)
    return row


def retractions_max(m: dict[str, float]) -> float | None:
    """The smallest histogram bucket that holds every finished request."""
    total = m.get("swaserve_request_retractions_count")
    if total is None:
        return None
    for le in ("0.0", "1.0", "2.0", "3.0", "5.0", "10.0", "+Inf"):
        if m.get(f'swaserve_request_retractions_bucket{{le="{le}"}}', -1) >= total:
            return float(le)
    return None


def scenario_disconnects(args) -> dict:
    srv = Server(args, "--max-model-len", "4096")
    try:
        rss0 = srv.rss_mb()
        rng = random.Random(0)

        async def run():
            jobs = []
            for i in range(args.streams):
                body = {"prompt": f"Story number {i}: once upon a time", "stream": True,
                        "max_tokens": 32 + i % 32, "temperature": 0.8, "seed": i,
                        "ignore_eos": True}
                if i % 3 == 1:
                    jobs.append(leave_early(srv.base, body, rng.randint(1, 3), i % 2 == 0))
                else:
                    jobs.append(stream(srv.base, body, 300))
            return await asyncio.gather(*jobs)
        t0 = time.monotonic()
        results = asyncio.run(run())
        wall = time.monotonic() - t0
        idle = srv.seconds_to_idle()
        return summarize("disconnects", results, srv, rss0, {
            "streams": args.streams, "wall_s": round(wall, 1), "idle_after_s": round(idle, 2)})
    finally:
        srv.stop()


def scenario_pressure(args) -> dict:
    # 4 rows of rings (60 MiB) + 6,800 tokens of full-layer KV + window pages: two of the
    # 3,000-token prompts fit, a third does not
    srv = Server(args, "--max-model-len", "4096", "--kv-memory", "100MiB",
                 "--max-running-requests", "4")
    try:
        rss0 = srv.rss_mb()
        words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu ").split()

        def prompt(i: int) -> str:
            r = random.Random(i)
            return " ".join(r.choice(words) for _ in range(2900))

        async def run():
            return await asyncio.gather(*[stream(srv.base, {
                "prompt": prompt(i), "max_tokens": 64, "stream": True, "temperature": 0,
                "ignore_eos": True}, args.pressure_timeout) for i in range(16)])
        t0 = time.monotonic()
        results = asyncio.run(run())
        wall = time.monotonic() - t0
        m = srv.metrics()
        return summarize("pressure", results, srv, rss0, {
            "wall_s": round(wall, 1), "preemptions": m.get("swaserve_preemptions_total"),
            "retractions_per_request_max": retractions_max(m)})
    finally:
        srv.stop()


def fuzz_bodies(n: int) -> list[tuple[str, object]]:
    fixed = [("completions", {"prompt": ""}), ("completions", {"prompt": [True]}),
             ("completions", {"prompt": "hi", "logprobs": 0}), ("completions", {"prompt": "hi", "n": 10000}),
             ("completions", {"prompt": "hi", "temperature": 1e-50, "logprobs": 2}),
             ("completions", {"prompt": "hi", "max_tokens": 10**12}),
             ("completions", {"prompt": "hi", "max_tokens": 10**30}),
             ("chat/completions", {"messages": [{"role": "tool"}]}),
             ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
             ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
             ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
             ("completions", '{"prompt": "\\ud800"}'), ("completions", '{"prompt": "x",,}')]
    fixed = [(route, {"max_tokens": 4, **body} if isinstance(body, dict) else body)
             for route, body in fixed]
    rng = random.Random(1)
    seeds = [("completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0.5, "logprobs": 2,
                              "stop": ["x"], "n": 2, "seed": 3}),
             ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                   "logprobs": True, "top_logprobs": 2})]
    junk = [None, True, -1, 0, 2**64, 1e308, "", "\x00", [], {}, [None], [[1, 2]], "hi", 10**30]
    out = list(fixed)
    while len(out) < n:
        route, body = rng.choice(seeds)
        body = json.loads(json.dumps(body))
        for _ in range(rng.randint(1, 3)):  # max_tokens stays small: the fuzz stays short
            key = rng.choice([*(k for k in body if k != "max_tokens"), "top_k", "min_p",
                              "logit_bias", "min_tokens", "regex"])
            body[key] = rng.choice(junk)
        out.append((route, body))
    return out


def scenario_fuzz(args) -> dict:
    srv = Server(args, "--max-model-len", "512")
    try:
        rss0 = srv.rss_mb()
        results, bad_shape = [], 0
        with httpx.Client(timeout=120) as c:
            for route, body in fuzz_bodies(args.fuzz):
                t0 = time.monotonic()
                kw = {"content": body.encode(), "headers": {"content-type": "application/json"}} \
                    if isinstance(body, str) else {"json": body}
                try:
                    r = c.post(f"{srv.base}/v1/{route}", **kw)
                except httpx.HTTPError:  # the server died or dropped the connection
                    results.append({"outcome": "failed", "status": 599})
                    if srv.proc.poll() is not None:
                        break
                    continue
                outcome = "completed" if r.status_code == 200 else (
                    "rejected" if r.status_code < 500 else "failed")
                if r.status_code >= 400:
                    err = r.json().get("error", {})
                    bad_shape += set(err) != {"message", "type", "param", "code"}
                results.append({"outcome": outcome, "status": r.status_code,
                                "latency": time.monotonic() - t0})
        return summarize("fuzz", results, srv, rss0, {
            "requests": len(results), "errors_not_openai_shaped": bad_shape,
            "server_died": srv.proc.poll() is not None})
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=["disconnects", "pressure", "fuzz"],
                    choices=["disconnects", "pressure", "fuzz"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--fuzz", type=int, default=300, help="fuzz requests")
    ap.add_argument("--pressure-timeout", type=float, default=300)
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH of the server process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.scenarios:
        print(f"{name}:", flush=True)
        rows.append(globals()[f"scenario_{name}"](args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print("\n| scenario | completed | disconnected | rejected | failed | truncated | hung | 5xx "
          "| p50 s | p99 s | RSS MB before / after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['completed']} | {r['disconnected']} | {r['rejected']} | "
              f"{r['failed']} | {r['truncated']} | {r['hung']} | {r['5xx']} | {r['p50_s']} | "
              f"{r['p99_s']} | {r['rss_mb_before']} / {r['rss_mb_after']} |")
    for r in rows:
        extra = {k: v for k, v in r.items() if k in (
            "wall_s", "idle_after_s", "preemptions", "retractions_per_request_max",
            "errors_not_openai_shaped", "server_died")}
        print(f"{r['scenario']}: {extra}")


if __name__ == "__main__":
    main()
