"""The attention and prefix-cache contracts with a quantized KV cache (`kv_cache_dtype` int8
and fp8_e4m3) on tiny random Gemma 3 models: each holds relative to an unchunked, cold run
with the same KV dtype, and the quantized logits stay near the float32 cache's."""

from __future__ import annotations

import pytest

from swaserve import SamplingParams
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, random_prompt, roomy_engine, run_logged, tiny_engine

TOL = 1e-4  # float32 round-off, as tests/models/test_attention_contracts.py

KV = ["int8", "fp8_e4m3"]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv", KV)
def test_chunked_prefill_equals_one_shot_with_the_same_kv_dtype(tiny_hybrid, kv):
    path = tiny_hybrid[0]
    prompt = random_prompt(4 * W + 5, seed=3)
    [(want, want_logs)] = run_logged(roomy_engine(path, kv_cache_dtype=kv), [prompt], 2 * W)
    for chunk in (1, 7, W + 1, 2 * W + 3):
        eng = roomy_engine(path, chunk_size=chunk, kv_cache_dtype=kv)
        assert eng.cache.window.k[0].dtype == eng.cache.kv_format.values != eng.cache.dtype
        [(tokens, logs)] = run_logged(eng, [prompt], 2 * W)
        assert tokens == want
        assert _max_diff(logs, want_logs) < TOL, f"chunk {chunk}"
    # and near the float32 cache's logits (these tiny models' logits are O(1))
    [(_, exact_logs)] = run_logged(roomy_engine(path), [prompt], 2 * W)
    assert _max_diff(want_logs[:1], exact_logs[:1]) < (0.05 if kv == "int8" else 0.5)


@pytest.mark.parametrize("kv", KV)
def test_batched_decode_of_mixed_lengths_equals_alone(tiny_hybrid, kv):
    path = tiny_hybrid[0]
    prompts = [random_prompt(2 + 7 * i, seed=200 + i) for i in range(6)]
    alone = [run_logged(roomy_engine(path, kv_cache_dtype=kv), [p], 2 * W)[0] for p in prompts]
    together = run_logged(roomy_engine(path, kv_cache_dtype=kv, chunk_size=13), prompts, 2 * W)
    for (ta, la), (tb, lb) in zip(alone, together):
        assert ta == tb and _max_diff(la, lb) < TOL


def _run(eng, prompts, params):
    eng.logits_log = []
    groups = [eng.add_request(p, params) for p in prompts]
    drive(eng)
    out = []
    for g in groups:
        out.append([(r.output_token_ids, r.num_cached_tokens,
                     [lg for rid, _, lg in eng.logits_log if rid == r.request_id]) for r in g])
        for r in g:
            eng.release(r.request_id)
    eng.check_integrity()
    assert eng.cache.is_fully_free()
    return out


@pytest.mark.parametrize("kv", KV)
def test_prefix_hits_equal_a_cold_run_with_the_same_kv_dtype(tiny_hybrid, kv):
    path = tiny_hybrid[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = random_prompt(5 * W + 3, seed=1)
    other = base[:4 * W] + random_prompt(9, seed=2)  # a hit in the middle of base
    eng = tiny_engine(path, kv_cache_dtype=kv)
    [[first]] = _run(eng, [base], params)
    [[again]] = _run(eng, [base], params)
    [[hit]] = _run(eng, [other], params)
    assert first[1] == 0 and again[1] >= len(base) - 4 and hit[1] == 4 * W
    cold = tiny_engine(path, kv_cache_dtype=kv, prefix_cache=False)
    for got, prompt in ((again, base), (hit, other)):
        [[ref]] = _run(cold, [prompt], params)
        assert got[0] == ref[0] and _max_diff(got[2], ref[2]) < TOL


@pytest.mark.parametrize("kv", KV)
def test_forked_completions_equal_each_seed_run_alone(tiny_hybrid, kv):
    path = tiny_hybrid[0]
    prompt = random_prompt(3 * W + 2, seed=9)  # forks copy a partial page and the rings

    def params(seed, n=1):
        return SamplingParams(temperature=0.9, seed=seed, n=n, max_tokens=2 * W, ignore_eos=True)

    eng = tiny_engine(path, kv_cache_dtype=kv, prefix_cache=False)
    [group] = _run(eng, [prompt], params(5, n=3))
    assert len({tuple(t) for t, _, _ in group}) > 1
    for i, (tokens, _, logs) in enumerate(group):  # child i draws from seed + i
        [[(alone, _, alone_logs)]] = _run(eng, [prompt], params(5 + i))
        assert tokens == alone and _max_diff(logs, alone_logs) < TOL
