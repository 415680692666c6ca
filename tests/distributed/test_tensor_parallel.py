"""Tensor parallelism on two CPU processes (gloo) against one, float32, tiny random models:
a hybrid Gemma 3 with 4 KV heads (split), the 1-KV-head shape of Gemma 3 270M (replicated),
a Llama, and a gpt-oss with sinks and MoE (experts split by columns). Logits over a prompt
longer than 3 W with chunked prefill, greedy tokens, continuous batching, a prefix hit and
n > 1 forks (the KV copies rank 0 makes outside a forward, replayed on rank 1); a dead rank
breaks the engine instead of hanging it."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from swaserve.checkpoint.shard import local_config
from swaserve.config import EngineConfig
from swaserve.distributed.group import GroupBroken
from swaserve.engine.engine import Engine
from swaserve.sampling.params import SamplingParams
from tests.conftest import HYBRID, TINY_WINDOW, random_prompt, write_tiny_gemma3
from tests.conftest import run_logging_logits as _run

W = TINY_WINDOW


@pytest.fixture(scope="module")
def gemma_4kv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_gemma4")
    write_tiny_gemma3(path, HYBRID, seed=11, num_heads=4, num_kv_heads=4)
    return str(path)


@pytest.fixture(scope="module")
def gemma_1kv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_gemma1")
    write_tiny_gemma3(path, HYBRID, seed=12, num_heads=4, num_kv_heads=1)
    return str(path)


def _engine(path, tp, **kw):
    kw.setdefault("max_model_len", 512)
    return Engine(model=path, dtype="float32", tensor_parallel_size=tp, kv_memory="64MiB",
                  chunk_size=7, **kw)


def _same_run(one, two, prompts, params):
    """Both engines give the same tokens and, row for row, the same logits (1e-5)."""
    t1, l1 = _run(one, prompts, params)
    t2, l2 = _run(two, prompts, params)
    assert t1 == t2
    for a, b in zip(l1, l2):
        assert [p for p, _ in a] == [p for p, _ in b]
        for (_, x), (_, y) in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def _same_as_one_rank(path, prompts, params):
    one, two = _engine(path, 1), _engine(path, 2)
    try:
        _same_run(one, two, prompts, params)
    finally:
        two.close()


@pytest.fixture(scope="module")
def one_4kv(gemma_4kv):
    return _engine(gemma_4kv, 1)


@pytest.fixture
def pair_4kv(one_4kv, gemma_4kv):
    """tp = 1 and tp = 2 engines of one model (torch.distributed allows one group a
    process: the tp = 2 engine is closed after each test)."""
    two = _engine(gemma_4kv, 2)
    yield one_4kv, two
    two.close()


def test_two_ranks_give_one_ranks_logits_and_tokens(pair_4kv):
    one, two = pair_4kv
    prompts = [random_prompt(3 * W + 5, seed=1), random_prompt(5, seed=2),
               random_prompt(W + 1, seed=3)]
    _same_run(one, two, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert two.model.layers[0].num_heads == 2 and two.model.embed.shape[0] == 64


def test_a_prefix_hit_and_forks_replay_on_every_rank(pair_4kv):
    one, two = pair_4kv
    base = random_prompt(3 * W, seed=7)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    for eng in (one, two):  # the first run caches the prompt's pages
        _run(eng, [base + [3]], params)
    hits = two.cache.prefix.hit_tokens
    _same_run(one, two, [base + [4, 5]], params)
    assert two.cache.prefix.hit_tokens > hits


def test_an_int8_kv_cache_splits_with_its_heads_and_replays_its_scales(gemma_4kv):
    """Each rank quantizes its own KV heads and replays rank 0's copies of values and
    scales: a prefix hit and forks give one rank's tokens, and its logits but where a
    split product's float32 round-off tips a value's rounding to the next int8 step."""
    one, two = (_engine(gemma_4kv, tp, kv_cache_dtype="int8") for tp in (1, 2))
    try:
        base = random_prompt(3 * W, seed=7)
        params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
        for eng in (one, two):
            _run(eng, [base + [3]], params)
        prompts = [base + [4, 5], random_prompt(3 * W + 5, seed=1)]
        (t1, l1), (t2, l2) = _run(one, prompts, params), _run(two, prompts, params)
        assert t1 == t2
        for a, b in zip(l1, l2):
            assert [p for p, _ in a] == [p for p, _ in b]
            assert max((x - y).abs().max().item() for (_, x), (_, y) in zip(a, b)) < 1e-3
        assert two.cache.prefix.hit_tokens > 0 and two.cache.full.k[0].dtype == torch.int8
    finally:
        two.close()


def test_one_kv_head_is_replicated(gemma_1kv):
    assert local_config(_cfg(gemma_1kv), 2).num_kv_heads == 1
    _same_as_one_rank(gemma_1kv, [random_prompt(2 * W + 3, seed=4), random_prompt(9, seed=5)],
                      SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))


def _cfg(path):
    from swaserve.checkpoint.source import resolve_model

    return resolve_model(path).model_config()


def test_shapes_that_do_not_split_are_refused(gemma_4kv):
    cfg = _cfg(gemma_4kv)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 attention heads"):
        local_config(cfg, 3)
    with pytest.raises(ValueError, match="speculative: not available"):
        EngineConfig(tensor_parallel_size=2, speculative="ngram")
    with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive"):
        EngineConfig(tensor_parallel_size=0)


def test_a_dead_rank_breaks_the_engine_instead_of_hanging(gemma_4kv):
    eng = _engine(gemma_4kv, 2)
    broken = []
    eng.tp.on_broken.append(broken.append)
    try:
        eng.add_request(random_prompt(20, seed=9), SamplingParams(temperature=0, max_tokens=400,
                                                                  ignore_eos=True))
        for _ in range(3):
            eng.step()
        os.kill(eng.tp.procs[0].pid, signal.SIGKILL)
        with pytest.raises(GroupBroken):
            for _ in range(1000):
                eng.step()
        assert eng.tp.group.broken
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_other_families_split_the_same_way(family, request):
    _same_as_one_rank(request.getfixturevalue(family)[0],
                      [random_prompt(3 * W + 2, seed=6), random_prompt(7, seed=8)],
                      SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))


def _children(pid: int, marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
        except OSError:
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry))
    return out


def test_the_server_serves_at_two_ranks_and_exits_when_one_dies(tiny_with_tokenizer):
    import time

    import openai

    from tests.conftest import start_server

    base, proc = start_server("--model", tiny_with_tokenizer, "--dtype", "float32",
                              "--tensor-parallel-size", "2", "--kv-memory", "64MiB",
                              "--max-model-len", "512", timeout=120)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        (worker,) = _children(proc.pid, "swaserve.distributed.workers")
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code != 0 and time.monotonic() - t0 < 60
        assert "rank 1 exited" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ranks_on_two_machines_meet_at_the_rendezvous(tiny_with_tokenizer):
    """Two `swaserve serve` commands, as two machines would run them (--nnodes 2, one rank
    each, one rendezvous): node 0 serves, node 1 computes, and both end on node 0's
    SIGTERM."""
    import subprocess
    import sys

    import httpx

    from tests.conftest import free_port, start_server, stop_server

    port = free_port()
    common = ["--model", tiny_with_tokenizer, "--dtype", "float32", "--kv-memory", "64MiB",
              "--max-model-len", "512", "--tensor-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", *common,
                              "--node-rank", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        base, node0 = start_server(*common, "--node-rank", "0", timeout=120)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stop_server(node0)
        assert node1.wait(timeout=60) == 0, node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()


def test_the_offline_api_with_grammars_and_sampling_at_two_ranks(tiny_with_tokenizer):
    from swaserve import LLM

    params = [SamplingParams(temperature=0, max_tokens=6, regex="[ab]{2,6}"),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=3, max_tokens=8,
                             presence_penalty=0.5, logprobs=2)]
    want = LLM(model=tiny_with_tokenizer, dtype="float32").generate(["hello", "x y"], params)
    llm = LLM(model=tiny_with_tokenizer, dtype="float32", tensor_parallel_size=2)
    try:
        got = llm.generate(["hello", "x y"], params)
    finally:
        llm.engine.close()
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    assert set(got[0].outputs[0].text) <= {"a", "b"}


def test_a_forward_that_raises_on_rank_0_breaks_the_group(gemma_4kv, monkeypatch):
    """A step failure is recoverable at tp = 1; at tp = 2 the other rank is already inside
    the step's collectives, so the group must stop rather than fall out of step."""
    eng = _engine(gemma_4kv, 2)
    try:
        eng.add_request(random_prompt(12, seed=2), SamplingParams(temperature=0, max_tokens=8))
        eng.step()

        def boom(*a, **kw):
            raise RuntimeError("injected")

        monkeypatch.setattr(eng.model.layers[0], "forward", boom)
        with pytest.raises(GroupBroken, match="injected"):
            eng.step()
        assert "injected" in eng.tp.group.broken
    finally:
        eng.close()
