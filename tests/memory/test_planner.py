"""Memory planning (docs/architecture.md): ring accounting, the plan, and admission by the same accounting."""

from __future__ import annotations

import pytest

from swaserve import LLM, SamplingParams
from swaserve.memory.layout import CacheLayout, LayerKind, LayerSpec
from swaserve.memory.planner import compare_accounting, fixed_bytes_per_row, plan_memory
from tests.conftest import TEST_DEVICE, random_prompt

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def gemma3_270m_layout() -> CacheLayout:
    return CacheLayout(tuple(
        LayerSpec(LayerKind.FULL, 1, 256) if (i + 1) % 6 == 0 else LayerSpec(LayerKind.SLIDING, 1, 256, window=512)
        for i in range(18)))


def plan(layout, budget, rows=None, chunk=512, page=16, max_len=32768):
    return plan_memory(layout, budget, 2, chunk_size=chunk, page_size=page, max_model_len=max_len,
                       max_running_requests=rows)


@pytest.mark.parametrize("budget", [256 * MIB, 1 * GIB, 3 * GIB + 12345])
@pytest.mark.parametrize("rows", [None, 4, 12])
def test_used_bytes_within_budget_and_page_aligned(budget, rows):
    p = plan(gemma3_270m_layout(), budget, rows, max_len=131072)
    assert p.used_bytes <= budget
    # all of it, unless every row at max length is already covered (more would never be used)
    assert p.used_bytes > 0.99 * budget or p.full_pool_tokens == p.num_rows * 131072
    assert p.ring % p.page_size == 0 and p.full_pool_tokens % p.page_size == 0


def test_capacity_monotonic_and_constraints_never_raise_it():
    lay = gemma3_270m_layout()
    prev = None
    for budget in (192 * MIB, 256 * MIB, 512 * MIB, GIB, 2 * GIB):
        acc = compare_accounting(lay, budget, 2, context=8192, chunk_size=512, page_size=16)
        capped = compare_accounting(lay, budget, 2, context=8192, chunk_size=512, page_size=16,
                                    max_running_requests=3)
        for k in acc:
            assert capped[k].max_concurrent_requests <= acc[k].max_concurrent_requests
            if prev:
                assert acc[k].max_concurrent_requests >= prev[k].max_concurrent_requests
                assert acc[k].full_pool_tokens >= prev[k].full_pool_tokens
        assert (plan(lay, budget, 8, max_len=200_000).full_pool_tokens
                <= plan(lay, budget, 4, max_len=200_000).full_pool_tokens)
        prev = acc


def test_all_sliding_no_sliding_and_fixed_state():
    sliding = CacheLayout((LayerSpec(LayerKind.SLIDING, 8, 128, window=4096),) * 4)
    p = plan(sliding, GIB, 8)
    assert p.full_pool_pages == 0 and p.full_bytes_per_token == 0 and p.ring > 0
    full = CacheLayout((LayerSpec(LayerKind.FULL, 8, 128),) * 4)
    q = plan(full, GIB, 8, max_len=4096)
    assert q.ring == 0 and q.fixed_bytes_per_row == 8 * 4096  # only its req-to-token row
    n = 123_457
    stateful = CacheLayout(full.layers[:3] + (LayerSpec(LayerKind.FULL, 8, 128, fixed_state_bytes=n),))
    r = plan(stateful, GIB, 8, max_len=4096)
    assert r.fixed_bytes_per_row == q.fixed_bytes_per_row + n  # once per row


def test_ring_rounded_up_to_whole_pages():
    lay = CacheLayout((LayerSpec(LayerKind.SLIDING, 1, 64, window=100), LayerSpec(LayerKind.FULL, 1, 64)))
    assert lay.ring_size(chunk_size=30, page_size=16) == 144  # 130 -> 9 pages
    assert lay.ring_size(chunk_size=28, page_size=16) == 128
    assert fixed_bytes_per_row(lay, 144, 2) == 144 * 2 * 64 * 2 + 144 * 8


def test_bundled_model_ring_vs_full_history_from_first_principles():
    lay = gemma3_270m_layout()
    budget, ctx = GIB, 8192
    n_full, n_sliding = 3, 15
    kv = 2 * 1 * 256 * 2  # K and V, one head of 256, bf16
    ring = 512 + 512  # W + chunk, already whole pages
    ring_req = n_sliding * kv * ring + 8 * ring + n_full * kv * ctx
    full_req = (n_full + n_sliding) * kv * ctx
    r_expected = (budget // ring_req) / (budget // full_req)
    acc = compare_accounting(lay, budget, 2, context=ctx, chunk_size=512, page_size=16)
    ratio = acc["ring"].max_concurrent_requests / acc["full_history"].max_concurrent_requests
    assert ratio >= r_expected
    assert acc["full_history"].max_concurrent_requests == budget // full_req
    assert acc["ring"].max_concurrent_requests == budget // ring_req


def test_plan_cli_figures_for_bundled_model(capsys):
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    rep = plan_report(EngineConfig(kv_memory="1GiB", dtype="bf16"), context=8192)
    acc = rep["accounting"]
    assert rep["layers"]["full"] == [5, 11, 17] and rep["layers"]["window"] == 512
    assert acc["ring"]["bytes_per_token"] == 3 * KIB
    assert acc["ring"]["fixed_bytes_per_request"] == 15 * KIB * 1024 + 8 * 1024
    assert acc["full_history"]["bytes_per_token"] == 18 * KIB
    assert acc["full_history"]["full_pool_tokens"] == GIB // (18 * KIB) // 16 * 16
    assert acc["full_history"]["max_concurrent_requests"] == 7  # 1 GiB / 144 MiB
    assert acc["ring"]["max_concurrent_requests"] == GIB // (15 * MIB + 8 * KIB + 24 * MIB)
    assert acc["token_scaled"]["bytes_per_token"] == 3 * KIB + 0.8 * 15 * KIB


def test_rings_hold_a_draft_longer_than_a_chunk_and_plan_shows_it(tiny_hybrid):
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    cfg = EngineConfig(kv_memory="1GiB", chunk_size=64, speculative="ngram",
                       num_draft_tokens=100)
    assert cfg.step_tokens == 101 and EngineConfig(chunk_size=64).step_tokens == 64
    lay = plan_report(cfg, context=8192)["layers"]
    assert lay["ring"] == 512 + 112 and lay["draft_allowance"] == 112 - 64  # 16-token pages
    eng = LLM(tiny_hybrid[0], dtype="float32", device=TEST_DEVICE, kv_memory="3MiB",
              max_running_requests=4, page_size=4, chunk_size=4, speculative="ngram",
              num_draft_tokens=6).engine
    assert eng.cache.window.ring == 8 + 8 and eng.cache.nbytes() == eng.plan.used_bytes


def test_engine_allocates_exactly_its_plan(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="3MiB", max_running_requests=4)
    eng = llm.engine
    assert eng.cache.nbytes() == eng.plan.used_bytes <= 3 * MIB


def test_admission_boundary_and_no_double_charge(tiny_hybrid):
    path, _ = tiny_hybrid
    # page 8, chunk 16: a 15-token prompt needs 2 pages (15 prompt + 1 decode token = 16)
    from swaserve.checkpoint.source import resolve_model

    lay = resolve_model(path).model_config().cache_layout()
    from swaserve.memory.planner import full_bytes_per_token

    ring = lay.ring_size(16, 8)
    budget = 2 * fixed_bytes_per_row(lay, ring, 4, 512) + 2 * 8 * full_bytes_per_token(lay, 4)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory=budget, max_running_requests=2,
              page_size=8, chunk_size=16, prefix_cache=False)
    eng = llm.engine
    assert eng.cache.num_total_pages == 2
    eng.add_request(random_prompt(15, 1), SamplingParams(temperature=0, max_tokens=1))
    batch = eng.scheduler.schedule()
    assert len(batch.seqs) == 1  # needed (2) <= free (2): admitted at the boundary
    # a chunked continuation keeps its row and is charged only for new pages (without
    # overlap, so that each step's pages are seen before the next step is scheduled)
    eng2 = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="8MiB", max_running_requests=1,
               page_size=8, chunk_size=8, overlap=False).engine
    calls = []
    eng2.cache.rows.register_on_alloc_rows(calls.append)
    r = eng2.add_request(random_prompt(40, 2), SamplingParams(temperature=0, max_tokens=2))[0]
    pages = []
    while eng2.has_unfinished():
        eng2.step()
        if r.row is not None:
            pages.append(len(eng2.cache.row_pages[r.row]))
    assert len(calls) == 1 and pages == sorted(pages) and pages[0] == 1


def test_burst_of_100_on_small_pool_completes(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="1MiB", max_running_requests=6,
              page_size=8, chunk_size=32)
    prompts = [random_prompt(5 + (i * 7) % 40, i) for i in range(100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert llm.engine.cache.is_fully_free()
    llm.engine.check_integrity()
