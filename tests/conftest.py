"""What the tests of every layer share: the device the tests run on (TEST_DEVICE, the
cpu_only marker), drive() for an engine's steps, tiny engines and their logged runs, the tiny
checkpoints as fixtures, and the app in process with its clients. The rest lives in
tests/helpers/ by kind (checkpoints, transformers' references, int8 data, GGUF files, server
processes) and is re-imported here, so that `from tests.conftest import X` finds it. A
helper one module uses stays in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from swaserve.config import cache_root
from swaserve.kernels import build
from tests.helpers.checkpoints import (  # noqa: F401  (re-exported)
    HYBRID,
    TINY_WINDOW,
    gpt_oss_config,
    write_byte_bpe_tokenizer,
    write_gpt_oss,
    write_llama,
    write_mistral,
    write_qwen3,
    write_tiny_gemma3,
)
from tests.helpers.gguf_writer import (  # noqa: F401  (re-exported)
    byte_bpe_vocab,
    sentencepiece_vocab,
    write_gguf,
)
from tests.helpers.quant import (  # noqa: F401  (re-exported)
    int8_copy,
    k_quant_blocks,
    q8_0_blocks,
    use_int8_copies,
    weight_from,
)
from tests.helpers.reference import hf_greedy, hf_logits, hf_logprobs  # noqa: F401
from tests.helpers.servers import free_port, start_server, stop_server  # noqa: F401

os.environ.setdefault("SWASERVE_NO_PROGRESS", "1")
# tests call kernels before (or without) loading a model, which would give their directory
build.use_cache_dir(cache_root() / "kernels")
# bitwise comparisons must not see a thread count change halfway (engine/threads.py);
# tests/engine/test_threads.py drives the governor itself
os.environ.setdefault("SWASERVE_FIXED_THREADS", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


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


# Tiny checkpoints of the other families (tests/helpers/checkpoints.py): (path, model)
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return write_mistral(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def gpt_oss_dim32(tmp_path_factory):
    """Heads of 32 dims: what the prompt attention kernel takes (multiples of 16)."""
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss_dim32"), head_dim=32)


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


def run_logged(engine, prompts, params, *, check_integrity: bool = False):
    """Runs of prompts to completion (`params`: SamplingParams, or a token count: greedy
    runs of that many tokens, eos ignored); per request, each prompt's n in turn, (tokens,
    [logits at each sample]); the pools checked after every step with `check_integrity`,
    and whole at the end."""
    from swaserve.sampling.params import SamplingParams

    engine.logits_log = []
    if isinstance(params, int):
        params = SamplingParams(temperature=0, max_tokens=params, ignore_eos=True)
    reqs = [r for p in prompts for r in engine.add_request(p, params)]
    drive(engine, check_integrity=check_integrity)
    out = []
    for r in reqs:
        logs = [lg for rid, _, lg in engine.logits_log if rid == r.request_id]
        out.append((list(r.output_token_ids), logs))
    assert engine.cache.is_fully_free()
    for r in reqs:
        engine.release(r.request_id)
    engine.check_integrity()
    return out


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
