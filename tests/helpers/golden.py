"""Golden outputs for a refactor that must change no behaviour: a fixed set of requests for
every family (greedy and seeded, chunked, batched, prefix hits, drafts, n > 1, logprobs,
prompt logprobs, int8 weights from GGUF, embeddings) and a fixed set of HTTP requests to the
in-process server (every surface, each chat format's reasoning and calls through scripted
outputs, bad bodies), written to one JSON file. Record before the change and after it on the
same machine; the two files must be byte-identical.

    python -m tests.helpers.golden OUT.json [--only engine|server]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("SWASERVE_NO_PROGRESS", "1")
os.environ.setdefault("SWASERVE_FIXED_THREADS", "1")

# (name, writer of the checkpoint at a path): writers from tests/helpers
FAMILIES = ["gemma3", "gemma4", "llama", "qwen3", "mistral", "gpt_oss",
            "qwen3_5", "qwen3_5_moe", "deepseek_v4", "gguf_llama3", "gguf_mistral",
            "gguf_qwen2", "gguf_qwen3", "gguf_gpt-oss", "gguf_gemma3", "gguf_gpt-oss-fused",
            "gguf_gemma4_shared", "gguf_gemma4_moe"]


def _write(name: str, path: Path) -> str:
    from tests.helpers import checkpoints as ck

    if name == "gemma3":
        ck.write_tiny_gemma3(path, ck.HYBRID, seed=1)
    elif name.startswith("gguf_"):
        return _write_gguf(name[5:], path)
    elif name == "gemma4":
        ck.write_tiny_gemma4(path)
    elif name == "llama":
        ck.write_llama(path)
    elif name == "qwen3":
        ck.write_qwen3(path)
    elif name == "mistral":
        ck.write_mistral(path)
    elif name == "gpt_oss":
        ck.write_gpt_oss(path)
    elif name == "qwen3_5":
        ck.write_tiny_qwen3_5(path)
    elif name == "qwen3_5_moe":
        ck.write_tiny_qwen3_5(path, moe=True)
    elif name == "deepseek_v4":
        ck.write_tiny_deepseek_v4(path)
    return str(path)


def _write_gguf(name: str, path: Path) -> str:
    """A GGUF of tests/checkpoint's tables, written as their fixtures write it."""
    from tests.checkpoint import test_gguf_families as fam
    from tests.checkpoint import test_gguf_gemma4 as g4
    from tests.helpers.checkpoints import write_tiny_gemma4
    from tests.helpers.gguf_writer import byte_bpe_vocab, sentencepiece_vocab, write_gguf

    file = path / "model.gguf"
    if name.startswith("gemma4_"):
        options, table = g4.VARIANTS[name[7:]]
        vocab = g4._vocab()
        _, model = write_tiny_gemma4(path / "hf", seed=3, vocab_size=vocab.size,
                                     vocab_size_per_layer_input=vocab.size, **options)
        write_gguf(file, model, "gemma4", vocab,
                   lambda n: table.get(n.split(".")[-2], g4.Q.F16))
        return str(file)
    arch, build, spec, types, options = fam.FAMILIES[name]
    vocab = (sentencepiece_vocab(prefix_space=spec == "sp") if isinstance(spec, str)
             else byte_bpe_vocab(*spec))
    torch.manual_seed(7)
    write_gguf(file, build(vocab.size).eval(), arch, vocab, fam._types(types), **options)
    return str(file)


def _prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _f(x: float) -> str:
    return float(x).hex()  # every bit of a float, so that "identical" means identical


def _logprobs(lp):
    if lp is None:
        return None
    return [None if d is None else {str(k): _f(v) for k, v in sorted(d.items())} for d in lp]


def _outputs(results) -> list:
    return [{"prompt_len": len(r.prompt_token_ids), "cached": r.num_cached_tokens,
             "prompt_logprobs": _logprobs(r.prompt_logprobs),
             "outputs": [{"ids": o.token_ids, "finish": o.finish_reason, "text": o.text,
                          "logprobs": _logprobs(o.logprobs)} for o in r.outputs]}
            for r in results]


def _family_runs(path: str, page_size: int = 4) -> dict:
    from swaserve.entrypoints.llm import LLM
    from swaserve.sampling.params import SamplingParams as SP

    out = {}
    base = dict(dtype="float32", kv_memory="32MiB", max_running_requests=8,
                page_size=page_size)
    long = _prompt(70, 1)  # many windows of the tiny models (window 8)
    mixed = [_prompt(n, 10 + n) for n in (5, 23, 41)]
    greedy = SP(temperature=0, max_tokens=12, ignore_eos=True)
    for chunk in (7, 16):
        llm = LLM(path, chunk_size=chunk, **base)
        out[f"chunk{chunk}_greedy"] = _outputs(llm.generate([long] + mixed, greedy))
        out[f"chunk{chunk}_prompt_logprobs"] = _outputs(llm.generate(
            long, SP(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=3,
                     ignore_eos=True)))
        if chunk == 16:
            seeded = SP(temperature=0.9, top_p=0.9, top_k=20, seed=42, max_tokens=10, n=2,
                        ignore_eos=True, presence_penalty=0.3, repetition_penalty=1.1)
            out["seeded_n2"] = _outputs(llm.generate(mixed, seeded))
            out["min_p_seeded"] = _outputs(llm.generate(
                long, SP(temperature=1.0, min_p=0.05, seed=7, max_tokens=8, ignore_eos=True)))
            # a prefix hit: the same prompt again, then extended past a window
            out["prefix_cold"] = _outputs(llm.generate(long + [5] * 3, greedy))
            out["prefix_hit"] = _outputs(llm.generate(long + [5] * 3 + _prompt(13, 3), greedy))
        del llm
    spec = LLM(path, chunk_size=16, speculative="ngram", **base)
    rep = (_prompt(6, 5) * 6)[:30]  # repeats give the n-gram drafts something to find
    out["drafts"] = _outputs(spec.generate([rep, long], greedy))
    return out


def _embedding_runs(tmp: Path) -> dict:
    from swaserve.entrypoints.llm import LLM
    from tests.helpers.embeddings import write_embedding_gemma

    path = tmp / "embedding_gemma"
    write_embedding_gemma(path)
    llm = LLM(str(path), dtype="float32", kv_memory="16MiB", chunk_size=16)
    vecs = llm.embed([_prompt(9, 1, 100), _prompt(30, 2, 100)])
    return {"embed": [[_f(x) for x in v] for v in vecs]}


def record_engine(tmp: Path) -> dict:
    out = {}
    for name in FAMILIES:
        path = tmp / name
        path.mkdir()
        print(f"golden: {name}", file=sys.stderr, flush=True)
        out[name] = _family_runs(_write(name, path), 8 if name == "deepseek_v4" else 4)
    out["embedding_gemma"] = _embedding_runs(tmp)
    return out


# Fields that differ between two runs of the same answer: ids and clocks
_VOLATILE = re.compile(
    r'"(id|created|created_at|completed_at|system_fingerprint|call_id|tool_call_id|'
    r'response_id|item_id)"\s*:\s*("[^"]*"|\d+(\.\d+)?)')
_IDS = re.compile(r"\b(chatcmpl|cmpl|resp|msg|call|toolu|fc|rs)[-_][A-Za-z0-9_-]+")


def _stable(text: str) -> str:
    return _IDS.sub(r"\1-X", _VOLATILE.sub(r'"\1": "X"', text))


HTTP = [  # (path, body) for the byte-BPE Gemma 3 model (completions and every surface)
    ("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 8,
                         "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": ["a b c", "the end"], "max_tokens": 6,
                         "temperature": 0.8, "seed": 3, "n": 2, "stop": ["e"]}),
    ("/v1/completions", {"model": "tiny", "prompt": "stream me", "max_tokens": 6,
                         "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, "echo": True,
                         "temperature": 0, "logprobs": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"999999": 1}}),
    ("/v1/completions", {"model": "tiny", "prompt": "x " * 5000, "max_tokens": 4}),
    ("/v1/completions", {"model": "tiny", "prompt": "j", "max_tokens": 12, "temperature": 0,
                         "response_format": {"type": "json_object"}}),
    ("/tokenize", {"model": "tiny", "prompt": "Hello there, world"}),
    ("/detokenize", {"model": "tiny", "tokens": [72, 101, 108]}),
    ("/v1/embeddings", {"model": "tiny", "input": "abc"}),
]


def _chat_http(model: str) -> list:
    """Requests on the chat-like surfaces for a model with a chat template."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    from tests.server.chat_models import TOOLS
    tools_resp = [{"type": "function", "name": t["function"]["name"],
                   "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]
    tools_anth = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in TOOLS]
    chat = {"model": model, "messages": user, "max_tokens": 200}
    return [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**chat, "tools": TOOLS}),
        ("/v1/chat/completions", {**chat, "tools": TOOLS, "stream": True}),
        ("/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required"}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "bogus", "content": "x"}]}),
        ("/v1/responses", {"model": model, "input": "What is the weather in Paris?",
                           "max_output_tokens": 200, "tools": tools_resp}),
        ("/v1/responses", {"model": model, "input": "Weather?", "max_output_tokens": 200,
                           "stream": True}),
        ("/v1/messages", {"model": model, "max_tokens": 200, "messages": user,
                          "tools": tools_anth}),
        ("/v1/messages", {"model": model, "max_tokens": 200, "messages": user,
                          "stream": True}),
        ("/v1/messages/count_tokens", {"model": model, "messages": user}),
        ("/v1/messages", {"model": model, "max_tokens": 0, "messages": user}),
    ]


async def _ask(app, path: str, body: dict, key: str | None = None) -> str:
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(path, json=body, headers=headers, timeout=120)
        return f"{r.status_code} {_stable(r.text)}"


def _serve(path: str, bodies: list, **engine_kw) -> list:
    """Each (path, body)'s status and stable body text from an in-process app on `path`."""
    from tests.conftest import inprocess_served

    served = inprocess_served(path, **engine_kw)
    app, _ = next(served)
    try:
        return [[p, asyncio.run(_ask(app, p, b))] for p, b in bodies]
    finally:
        next(served, None)


# Scripted outputs in each tested family's own format (reasoning, a call, plain text)
GPT_OSS_SCRIPTS = [
    "<|channel|>analysis<|message|>The user asks about weather.<|end|><|start|>assistant"
    "<|channel|>final<|message|>It is sunny in Paris.<|return|>",
    "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions."
    'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
]
QWEN3_SCRIPTS = [
    "<think>\nThe user asks.\n</think>\n\nIt is sunny.",
    '<think>\nNeed a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>',
    "Plain words, no think block.",
]


def record_server(tmp: Path) -> dict:
    from tests.helpers.checkpoints import HYBRID, write_byte_bpe_tokenizer, write_tiny_gemma3

    path = tmp / "tiny_tok"
    path.mkdir()
    vocab = write_byte_bpe_tokenizer(path)
    write_tiny_gemma3(path, HYBRID, vocab=vocab, seed=3)
    out = {"gemma3_bpe": _serve(str(path), HTTP)}
    out["gpt_oss_chat"] = _serve_chat(tmp, "gpt_oss_chat", GPT_OSS_SCRIPTS)
    out["qwen3_chat"] = _serve_chat(tmp, "qwen3_chat", QWEN3_SCRIPTS)
    return out


def _serve_chat(tmp: Path, fixture: str, scripts: list) -> list:
    """A chat model of tests/server/chat_models.py, built as its fixture builds it."""
    from tests.server import chat_models

    class _Factory:
        def mktemp(self, name):
            d = tmp / name
            d.mkdir()
            return d

    gen = getattr(chat_models, fixture).__wrapped__(_Factory())
    app, aeng = next(gen)
    eng = aeng.engine
    out = []
    try:
        for text in scripts:
            chat_models.script((app, aeng), text)
            for p, b in _chat_http("tiny"):
                out.append([text, p, asyncio.run(_ask(app, p, b))])
    finally:
        next(gen, None)
    del eng
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", choices=["engine", "server"])
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from swaserve.config import cache_root
    from swaserve.kernels import build
    build.use_cache_dir(cache_root() / "kernels")
    result = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only != "server":
            result["engine"] = record_engine(tmp)
        if args.only != "engine":
            result["server"] = record_server(tmp)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
