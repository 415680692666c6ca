"""What the tests of every layer share: tiny random-weight checkpoints written by
transformers itself (Gemma 3, Llama 3, Qwen3, Mistral, gpt-oss) and its references
(hf_logits, hf_logprobs, hf_greedy), the device the tests run on (TEST_DEVICE, the cpu_only
marker), drive() for an engine's steps, GGUF block data for the int8 paths, and servers:
a `swaserve serve` process, or the app in process with its clients. A helper one module uses
stays in it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from swaserve.config import cache_root
from swaserve.kernels import build

os.environ.setdefault("SWASERVE_NO_PROGRESS", "1")
# tests call kernels before (or without) loading a model, which would give their directory
build.use_cache_dir(cache_root() / "kernels")
# bitwise comparisons must not see a thread count change halfway (engine/threads.py);
# tests/engine/test_threads.py drives the governor itself
os.environ.setdefault("SWASERVE_FIXED_THREADS", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_WINDOW = 8

# The device the device-independent tests build their engines on: cpu unless
# SWASERVE_TEST_DEVICE names another (cuda, cuda:1). Tests of what only the CPU has (the
# C kernels, AMX/VNNI, the thread governor, MLX on its CPU build) carry the cpu_only
# marker and skip there; kernels/ and mlx/ carry it whole.
TEST_DEVICE = os.environ.get("SWASERVE_TEST_DEVICE", "cpu")
CPU_ONLY_FOLDERS = ("kernels", "mlx")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: tests of what only the CPU has; skipped "
                                       "where SWASERVE_TEST_DEVICE is not cpu")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"CPU only; SWASERVE_TEST_DEVICE is {TEST_DEVICE}")
    for item in items:
        if item.path.parent.parent == here and item.path.parent.name in CPU_ONLY_FOLDERS:
            item.add_marker(pytest.mark.cpu_only)
        if TEST_DEVICE != "cpu" and item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


def drive(engine, until=None, *, max_steps: int = 10_000, check_integrity: bool = False,
          each_step=None) -> int:
    """Step `engine` until `until()` holds (by default: until it has no unfinished request);
    the number of steps taken. `check_integrity` checks the pools after every step,
    `each_step(engine)` runs after every step; a run past `max_steps` fails the test, so
    that a hang is a failure instead of a spin."""
    done = until or (lambda: not engine.has_unfinished())
    steps = 0
    while not done():
        if steps >= max_steps:
            pytest.fail(f"still running after {max_steps} steps")
        engine.step()
        steps += 1
        if check_integrity:
            engine.check_integrity()
        if each_step is not None:
            each_step(engine)
    return steps


def write_tiny_gemma3(path, layer_types, window=TINY_WINDOW, vocab=128, seed=0,
                      max_positions=512, num_heads=2, num_kv_heads=1):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=16,
        sliding_window=window,
        layer_types=layer_types, max_position_embeddings=max_positions, query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights so that (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


HYBRID = ["sliding_attention", "sliding_attention", "full_attention",
          "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hybrid")
    model = write_tiny_gemma3(path, HYBRID)
    return str(path), model


@pytest.fixture(scope="session")
def tiny_all_sliding(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sliding")
    model = write_tiny_gemma3(path, ["sliding_attention"] * 4, seed=1)
    return str(path), model


@pytest.fixture(scope="session")
def tiny_no_sliding(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_full")
    model = write_tiny_gemma3(path, ["full_attention"] * 3, seed=2)
    return str(path), model


# Tiny checkpoints of the other families, saved by transformers' own classes: Llama 3
# (RoPE scaling, no window), Qwen3 (q/k norm), Mistral (a window on every layer),
# gpt-oss (sinks, MoE, YaRN)
FAMILY_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=2,
              eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)


def _save(model, path):
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path), model


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(**FAMILY_COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    return _save(_randomize_norms(LlamaForCausalLM(cfg)), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    cfg = Qwen3Config(**FAMILY_COMMON, num_hidden_layers=3, tie_word_embeddings=True)
    return _save(_randomize_norms(Qwen3ForCausalLM(cfg)), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    cfg = MistralConfig(**FAMILY_COMMON, num_hidden_layers=3, sliding_window=TINY_WINDOW, tie_word_embeddings=False)
    return _save(_randomize_norms(MistralForCausalLM(cfg)), tmp_path_factory.mktemp("mistral"))


def gpt_oss_config(**kw):
    from transformers import GptOssConfig

    c = dict(FAMILY_COMMON)
    c.update(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW,
             layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 64})
    c.update(kw)
    return GptOssConfig(**c)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _gpt_oss(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="module")
def gpt_oss_dim32(tmp_path_factory):
    """Heads of 32 dims: what the prompt attention kernel takes (multiples of 16)."""
    return _gpt_oss(tmp_path_factory, "gpt_oss_dim32", head_dim=32)


def _gpt_oss(tmp_path_factory, name, **kw):
    from transformers import GptOssForCausalLM

    torch.manual_seed(6)
    model = GptOssForCausalLM(gpt_oss_config(**kw))
    with torch.no_grad():  # strong sinks, so that a missing sink changes the result
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return _save(_randomize_norms(model), tmp_path_factory.mktemp(name))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over ids: row i predicts token i + 1."""
    return torch.log_softmax(hf_logits(model, ids), dim=-1)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens, eos included like ignore_eos (its
    generate() with min_new_tokens would ban eos instead)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def tiny_engine(path, **kw):
    """An Engine for a tiny checkpoint: float32 on TEST_DEVICE, small pool and pages
    (override any)."""
    from swaserve.engine.engine import Engine

    kw = {"dtype": "float32", "kv_memory": "16MiB", "max_running_requests": 8,
          "page_size": 4, "chunk_size": 16, "device": TEST_DEVICE, **kw}
    return Engine(model=path, **kw)


def roomy_engine(path, **kw):
    """An Engine for a tiny checkpoint with room: float32 on TEST_DEVICE, 64 MiB of KV, 16
    rows, the engine's own page and chunk sizes (override any)."""
    from swaserve.engine.engine import Engine

    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_memory", "64MiB")
    kw.setdefault("max_running_requests", 16)
    kw.setdefault("device", TEST_DEVICE)
    return Engine(model=path, **kw)


def run_logged(engine, prompts, max_tokens: int):
    """Greedy runs of prompts to completion; per request (tokens, [logits at each sample]);
    then the pools must be whole."""
    from swaserve.sampling.params import SamplingParams

    engine.logits_log = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    drive(engine)
    out = []
    for r in reqs:
        logs = [lg for rid, _, lg in engine.logits_log if rid == r.request_id]
        out.append((list(r.output_token_ids), logs))
    assert engine.cache.is_fully_free()
    engine.check_integrity()
    return out


def int8_copy(w: torch.Tensor, kind: str = "q8_0"):
    """w as int8 with a float scale per 32 inputs, in tile order: Q8_0's rule (values in
    -127..127), Q5_0's range (-15..15) or Q4_K's form (0..15, a minimum per 32 as offset)."""
    from swaserve.kernels.q8_weight import Q8Weight

    blocks = w.float().view(w.shape[0], -1, 32)
    if kind == "q4_k":
        lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
        scales = (hi - lo).clamp_min(1e-8) / 15
        q = ((blocks - lo[:, :, None]) / scales[:, :, None]).round().clamp(0, 15).to(torch.int8)
        return Q8Weight(q.view(w.shape), scales, -lo).to_tiles()
    levels = {"q8_0": 127, "q5_0": 15}[kind]
    scales = blocks.abs().amax(dim=2).clamp_min(1e-8) / levels
    q = (blocks / scales[:, :, None]).round().clamp(-levels, levels).to(torch.int8)
    return Q8Weight(q.view(w.shape), scales).to_tiles()


# GGUF block data for the int8 paths (kernels/q8.py, mlx/quant.py)
def q8_0_blocks(w: np.ndarray) -> np.ndarray:
    """w as GGUF Q8_0 blocks, quantized by the gguf package itself."""
    import gguf

    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)


def k_quant_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF Q4_K / Q6_K data with finite float16 d (and dmin): every bit pattern
    of the packed scales and values occurs."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    sb = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    d = (rng.random((len(sb), 2)) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        sb[:, 0:4] = d
    else:
        sb[:, 208:210] = d[:, :2]
    return sb.reshape(-1)


def weight_from(kind: str, raw: np.ndarray, n: int, k: int):
    """A Q8Weight read from Q4_K or Q6_K blocks."""
    from swaserve.kernels.q8_weight import Q8Weight

    return {"Q4_K": Q8Weight.from_q4_k_blocks,
            "Q6_K": Q8Weight.from_q6_k_blocks}[kind](raw, n, k)


def use_int8_copies(eng, kind: str = "q8_0", int8_activations: bool = False) -> None:
    """Give a bf16 engine's model int8 copies of its layer weights and LM head, as a GGUF's
    quantized tensors would (the tiny checkpoints are safetensors); `kind` for the layers,
    with `int8_activations` their products past q8_vnni's rows on q8_dpbusd."""
    eng.model.use_q8({"lm_head": int8_copy(eng.model.embed),
                      **{f"{i}.{name}": int8_copy(getattr(layer, name), kind)
                         for i, layer in enumerate(eng.model.layers)
                         for name in ("qkv", "o", "gate_up", "down")}},
                     int8_activations=int8_activations)


def run_logging_logits(eng, prompts, params):
    """Run prompts to the end on `eng`: each request's tokens (every one of n > 1) and its
    sampled logits rows as (position, float32 row) in step order."""
    eng.logits_log = []
    reqs = [r for p in prompts for r in eng.add_request(p, params)]
    drive(eng)
    logs: dict[str, list] = {}
    for rid, pos, row in eng.logits_log:
        logs.setdefault(rid, []).append((pos, row))
    return [r.output_token_ids for r in reqs], [logs.get(r.request_id, []) for r in reqs]


def random_prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def write_byte_bpe_tokenizer(path, vocab: int = 320) -> int:
    """A small byte-level BPE tokenizer.json (ids 0/1/2 = pad/eos/bos, like the tiny
    models); returns its vocabulary size. Any text encodes, as with a real tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ['{"name": "abc", "age": 12, "tags": ["x", "y"]}',
              "hello world 123-4567 true false null", "[1, 2, 3.5]"] * 50
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(os.path.join(str(path), "tokenizer.json"))
    return tk.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory):
    """A tiny hybrid model with a real (byte-level BPE) tokenizer, for text-level features."""
    path = tmp_path_factory.mktemp("tiny_tok")
    vocab = write_byte_bpe_tokenizer(path)
    write_tiny_gemma3(path, HYBRID, vocab=vocab, seed=3)
    return str(path)


@pytest.fixture(scope="session")
def tiny_long_context(tmp_path_factory):
    """Like tiny_with_tokenizer with a 32k context: streams that last, prompts that take
    a while to tokenize (the server tests)."""
    path = tmp_path_factory.mktemp("tiny_long")
    vocab = write_byte_bpe_tokenizer(path)
    write_tiny_gemma3(path, HYBRID, vocab=vocab, seed=4, max_positions=32768)
    return str(path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, timeout: float = 300):
    """`swaserve serve ARGS` on a free loopback port: (base URL, process), once /health
    answers. Its stdout and stderr go to the process's pipe (read it after it exits)."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    env = {**os.environ, "SWASERVE_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", "--port", str(port),
                             *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s")


def stop_server(proc, timeout: float = 60) -> str:
    """SIGTERM, then its exit status must be 0; returns what it printed."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def inprocess_served(path: str, **engine_kw):
    """An app (model name "tiny") over a float32 Engine of `path` on TEST_DEVICE, with its
    AsyncEngine (a generator for a fixture: yields (app, AsyncEngine), then shuts the engine
    down and checks that its memory is whole again)."""
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=path, **{"dtype": "float32", "device": TEST_DEVICE, **engine_kw})
    aeng = AsyncEngine(eng)
    yield create_app(aeng, "tiny"), aeng
    aeng.shutdown()
    assert eng.cache.is_fully_free()


def inprocess_app(path: str, **engine_kw):
    """inprocess_served's app alone (a generator for a fixture, the same shutdown)."""
    for app, _ in inprocess_served(path, **engine_kw):
        yield app


def asgi_client(app, timeout: float = 60):
    """An httpx.AsyncClient on the app in process (httpx's ASGI transport), at http://t."""
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=timeout)


def run_client(app, fn):
    """fn(openai.AsyncOpenAI, httpx.AsyncClient) against the app in process, its result."""
    import asyncio

    import openai

    async def go():
        async with asgi_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x",
                                        http_client=http, max_retries=0)
            return await fn(client, http)
    return asyncio.run(go())
