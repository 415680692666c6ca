"""The prefix cache contract (docs/architecture.md): prefix hits on a hybrid SWA model are exact (tiny random Gemma 3, W = 8)."""

from __future__ import annotations

import pytest
import torch

from swaserve import SamplingParams
from swaserve.engine.engine import Engine
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, random_prompt, use_int8_copies
from tests.conftest import tiny_engine as engine

TOL = 1e-4


def run(eng: Engine, prompts, max_tokens=12):
    eng.logits_log = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [eng.add_request(p, params)[0] for p in prompts]
    drive(eng)
    out = [(r.output_token_ids, r.num_cached_tokens,
            [lg for rid, _, lg in eng.logits_log if rid == r.request_id]) for r in reqs]
    for r in reqs:
        eng.release(r.request_id)
    eng.check_integrity()
    assert eng.cache.is_fully_free()
    return out


def cold(path, prompt, max_tokens=12):
    return run(engine(path, prefix_cache=False), [prompt], max_tokens)[0]


def assert_same(hit, ref):
    assert hit[0] == ref[0]
    assert max((a - b).abs().max().item() for a, b in zip(hit[2], ref[2])) < TOL


def test_exact_repeat_and_shared_prefix_with_new_suffix(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path)
    base = random_prompt(5 * W + 3, seed=1)
    first = run(eng, [base])[0]
    assert first[1] == 0
    again = run(eng, [base])[0]
    assert again[1] >= len(base) - 4  # everything but the last (partial) page is a hit
    assert_same(again, first)
    other = base[:4 * W] + random_prompt(9, seed=2)
    hit = run(eng, [other])[0]
    assert hit[1] == 4 * W  # the hit is in the middle of the earlier prompt
    assert_same(hit, cold(path, other))


def test_prefix_shorter_than_window(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path)
    p1 = random_prompt(W - 2, seed=3) + random_prompt(5, seed=4)
    run(eng, [p1])
    p2 = p1[:W - 2] + random_prompt(6, seed=5)
    hit = run(eng, [p2])[0]
    assert 0 < hit[1] < W
    assert_same(hit, cold(path, p2))


def test_hit_falls_back_to_an_earlier_restorable_point(tiny_hybrid):
    path, _ = tiny_hybrid
    # window pages for only 6 pages: the later pages of a long prompt get none, so the
    # longest restorable hit ends where the window pages end, and the rest is recomputed
    from swaserve.memory.planner import sliding_bytes_per_token

    eng = engine(path, window_cache_memory=str(6 * 4 * 4 * 2 * 16 * 4))
    assert eng.cache.window_pages.allocator.num_pages == 6
    assert sliding_bytes_per_token(eng.layout, 4) == 4 * 2 * 16 * 4
    prompt = random_prompt(12 * 4 + 1, seed=6)
    run(eng, [prompt])
    hit = run(eng, [prompt[:11 * 4] + random_prompt(3, seed=7)])[0]
    assert 0 < hit[1] <= 6 * 4  # an earlier point than the 44 cached tokens
    assert_same(hit, cold(path, prompt[:11 * 4] + random_prompt(3, seed=7)))


def test_four_turn_chat_hits_each_previous_turn(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path)
    history: list[int] = random_prompt(6, seed=10)
    for turn in range(4):
        history = history + random_prompt(5 + turn, seed=20 + turn)
        (tokens, cached, logs) = run(eng, [history], max_tokens=6)[0]
        if turn:
            assert cached >= len(history) - 5 - turn - 6 - 4
        assert_same((tokens, cached, logs), cold(path, history, 6))
        history = history + tokens


def test_concurrent_requests_sharing_a_system_prompt(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path)
    system = random_prompt(3 * W, seed=30)
    prompts = [system + random_prompt(4 + i, seed=40 + i) for i in range(5)]
    res = run(eng, prompts)
    assert sum(1 for r in res if r[1] > 0) >= 1
    for p, r in zip(prompts, res):
        assert_same(r, cold(path, p))


def test_eviction_under_pressure_and_return_to_fully_free(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path, kv_memory="300KiB", max_running_requests=4)
    total = eng.cache.num_total_pages
    prompts = [random_prompt(20 + i, seed=50 + i) for i in range(30)]  # far more than the pool
    outs = run(eng, prompts, max_tokens=8)
    assert all(len(o[0]) == 8 for o in outs)
    assert eng.cache.prefix.num_nodes > 0  # something is still cached ...
    eng.cache.evict_all()  # ... and eviction returns everything
    assert eng.cache.full.allocator.num_free == total
    wp = eng.cache.window_pages.allocator
    assert wp.num_free == wp.num_pages
    eng.check_integrity()


def test_eviction_never_touches_pages_in_use(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path, kv_memory="300KiB", max_running_requests=4)
    long = random_prompt(40, seed=60)
    r = eng.add_request(long, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    drive(eng, until=lambda: r.num_output_tokens >= 2)
    mine = list(eng.cache.row_pages[r.row])
    eng.cache.prefix.evict(full_pages=10**6, window_pages=10**6)  # evict everything it may
    assert all(eng.cache.full.allocator.refcount[p] >= 1 for p in mine)
    assert eng.cache.prefix.num_nodes > 0  # the running request's prefix is locked
    drive(eng)
    assert r.output_token_ids == cold(path, long, 30)[0]


def test_logits_after_hit_equal_cold_logits(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = engine(path, chunk_size=7)
    p = random_prompt(6 * W, seed=70)
    run(eng, [p])
    q = p[:5 * W + 1] + random_prompt(4, seed=71)
    hit = run(eng, [q], max_tokens=10)[0]
    ref = cold(path, q, 10)
    assert hit[1] > 0
    diffs = [(a - b).abs().max().item() for a, b in zip(hit[2], ref[2])]
    assert max(diffs) < TOL and torch.equal(torch.tensor(hit[0]), torch.tensor(ref[0]))


def test_bf16_hit_through_the_decode_attention_kernel_is_bitwise_cold(tiny_hybrid, monkeypatch):
    """bf16 on the CPU decodes through kernels/attention.c, which reads the restored ring
    slots and shared pages in place: after a mid-prompt hit, decoding three windows gives
    the cold run's tokens and logits bit for bit."""
    from swaserve.kernels import attention as kernel
    from swaserve.kernels import build
    from swaserve.models import attention as backend

    if build.load("attention") is None:
        pytest.skip("no C compiler for the kernel")
    calls = []

    def counted(*a, **kw):
        out = kernel.decode_attention_bf16(*a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(backend, "decode_attention_bf16", counted)
    path, _ = tiny_hybrid
    eng = engine(path, dtype="bfloat16")
    base = random_prompt(5 * W + 3, seed=80)
    run(eng, [base], 3 * W)
    other = base[:4 * W] + random_prompt(9, seed=81)
    hit = run(eng, [other], 3 * W)[0]
    ref = run(engine(path, prefix_cache=False, dtype="bfloat16"), [other], 3 * W)[0]
    assert hit[1] == 4 * W and any(calls), "no hit, or the kernel was not used"
    assert hit[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(hit[2], ref[2]))


@pytest.mark.cpu_only
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("chunk", [12, 64])
def test_int8_hit_recomputes_its_tail_as_the_cold_chunk_did(tiny_hybrid, chunk,
                                                            int8_activations):
    """With int8 weights, steps with prompt rows multiply on one kernel (q8_amx, or
    without AMX q8_dpbf16, or with `int8_activations` q8_dpbusd) up to its PROMPT_*_ROWS
    rows (ForwardContext.q8_kernel), though pure decode steps of few rows take another
    (q8_vnni): a hit's 4-row tail gives the bits of the cold run's chunk holding those
    rows (12 rows, or the whole 36-token prompt in one chunk)."""
    from swaserve.kernels import q8

    kernel = q8.prompt_kernel()
    want = "dpbusd" if int8_activations else kernel
    if q8.tile_kernel(chunk, kernel, int8=int8_activations) != want or not q8.vnni_available():
        pytest.skip("needs q8_vnni and a prompt step's int8 tile kernel")
    path, _ = tiny_hybrid
    base = random_prompt(5 * W + 3, seed=80)
    other = base[:4 * W] + random_prompt(4, seed=81)
    assert chunk <= min(q8.PROMPT_AMX_ROWS, q8.PROMPT_DPBF16_ROWS)  # every prompt step on it
    runs = []
    for cache in (True, False):
        eng = engine(path, dtype="bfloat16", prefix_cache=cache, chunk_size=chunk)
        use_int8_copies(eng, int8_activations=int8_activations)
        if cache:
            run(eng, [base], 3 * W)
        runs.append(run(eng, [other], 3 * W)[0])
    hit, ref = runs
    assert hit[1] == 4 * W and hit[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(hit[2], ref[2]))


def test_eviction_takes_the_least_recently_used_unlocked_leaf_each_time():
    """Random inserts, hits, locks and unlocks on a bare tree; each eviction of one page
    takes exactly the leaf a walk of the whole tree finds least recently used (its heap,
    with stale entries skipped, stays true to the tree), and a locked leaf never goes."""
    import random

    from swaserve.memory.full_pool import PageAllocator
    from swaserve.memory.prefix_cache import PrefixCache

    p, rnd = 4, random.Random(0)
    alloc = PageAllocator(400, p)
    tree = PrefixCache(p, 8, True, False, alloc, None)
    prompts = [[rnd.randrange(6) for _ in range(p * rnd.randrange(1, 6))] for _ in range(60)]
    locked = []
    evictions = 0
    for _ in range(600):
        op = rnd.random()
        if op < 0.35:
            tokens = rnd.choice(prompts)
            pages = alloc.alloc(len(tokens) // p)
            if pages is None:
                continue
            tree.insert(tokens, pages, [])
            alloc.decref(pages)  # the tree's own references remain
        elif op < 0.55:
            hit = tree.match(rnd.choice(prompts))
            if hit.num_tokens and rnd.random() < 0.5:
                tree.lock(hit.node, +1)
                locked.append(hit.node)
        elif op < 0.7 and locked:
            tree.lock(locked.pop(rnd.randrange(len(locked))), -1)
        else:
            leaves = tree._leaves()
            if not leaves:
                continue
            expected = min(leaves, key=lambda n: n.last_access)
            before = tree.num_nodes
            assert tree.evict(full_pages=alloc.num_free + 1)
            assert tree.num_nodes == before - 1 and expected not in tree._leaves()
            assert all(n.parent.children.get(n.tokens) is n for n in locked)
            evictions += 1
    assert evictions > 50
    while locked:
        tree.lock(locked.pop(), -1)
    tree.evict(full_pages=alloc.num_pages)
    assert tree.num_nodes == 0 and alloc.num_free == alloc.num_pages
