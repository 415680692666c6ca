"""tests/engine/test_engine_fuzz.py's workloads on the tiny Qwen3.5 model (recurrent state in
every request row): arrivals over the first steps, aborts, retractions on a pool too small
for all, n > 1 forks, n-gram drafts; then prefix hits through state checkpoints on a
checkpoint budget that drops them. Every request that is not aborted gets the tokens it
gets alone and cold; the pools (state slots, draft snapshots and checkpoints included) stay
whole after every step. Bounded: a few derandomized examples."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.engine.request import FinishReason
from tests.conftest import drive, tiny_engine
from tests.engine.test_engine_fuzz import REQUEST, STALL_STEPS, params_of, prompt_of
from tests.helpers.checkpoints import write_tiny_qwen3_5

EXAMPLES = 5
STATS = {"retracted": 0, "aborted": 0, "compared": 0, "cached_tokens": 0,
         "drafts_accepted": 0, "checkpoints_dropped": 0}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_fuzz"), seed=5)[0]


def engine(path, pages: int = 40, checkpoints: int = 0, **kw):
    """4 rows, `pages` of 4 tokens' full-layer KV and room for `checkpoints` state
    checkpoints: a few requests at once, and those that grow past the pool retract."""
    probe = tiny_engine(path, max_running_requests=4, prefix_cache=False, **{
        k: v for k, v in kw.items() if k != "prefix_cache"})
    plan = probe.plan
    page = plan.full_bytes_per_token * 4
    budget = (4 * plan.fixed_bytes_per_row + pages * page
              + (plan.draft_state_slots + checkpoints) * plan.state_slot_bytes)
    return tiny_engine(path, kv_memory=budget, max_running_requests=4, page_size=4,
                       chunk_size=16, state_cache_memory=checkpoints * plan.state_slot_bytes
                       or None, state_checkpoint_interval=8, **kw)


@pytest.fixture(scope="module")
def reference(qwen):
    eng = engine(qwen, prefix_cache=False, batch_invariant=True)
    seen: dict = {}

    def tokens(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in seen:
            reqs = eng.add_request(prompt, params)
            drive(eng)
            seen[key] = [r.output_token_ids for r in reqs]
        STATS["compared"] += 1
        return seen[key]
    yield tokens
    assert STATS["retracted"] >= 1 and STATS["aborted"] >= 2, STATS
    assert STATS["drafts_accepted"] >= 10 and STATS["cached_tokens"] >= 50, STATS
    assert STATS["compared"] >= 20 and STATS["checkpoints_dropped"] > 0, STATS


def check_pool_returns(eng) -> None:
    eng.check_integrity()
    eng.cache.evict_all()
    assert eng.cache.full.allocator.num_free == eng.cache.num_total_pages
    ck = eng.cache.state.checkpoints
    assert ck.num_free == ck.num_pages and not eng.cache.state.drafts


@pytest.mark.parametrize("speculative", [None, "ngram"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(specs=st.lists(REQUEST, min_size=1, max_size=7))
def test_fuzzed_workloads_give_every_request_its_tokens_alone(qwen, reference, speculative,
                                                              specs):
    """Batch-invariant mode (float32; the prefix cache off): a request's rows and chunks
    are computed the same way whatever shares its steps, retracted or not, drafted or not."""
    # 38 pages: the longest request (30 + 20 prompt tokens, 100 new) alone
    eng = engine(qwen, pages=38, batch_invariant=True, speculative=speculative)
    assert eng.cache.num_total_pages == 38
    if eng.speculator is not None:
        eng.speculator.gate.allow = lambda n: True
    added = []
    step = last_progress = 0
    progress = (0, 0)
    while step == 0 or eng.has_unfinished() or any(s["arrive"] >= step for s in specs):
        for i, spec in enumerate(specs):
            if spec["arrive"] == step:
                prompt, params = prompt_of(spec, i), params_of(spec, seed=i)
                added.append((spec, prompt, params, eng.add_request(prompt, params)))
        for spec, _, _, reqs in added:
            if spec["abort_at"] == step:
                for r in reqs:
                    eng.abort(r.request_id)
        eng.step()
        eng.check_integrity()
        step += 1
        reqs = [r for *_, rs in added for r in rs]
        now = (sum(r.num_output_tokens for r in reqs), sum(r.is_finished for r in reqs))
        if now != progress:
            progress, last_progress = now, step
        assert step - last_progress <= STALL_STEPS
    check_pool_returns(eng)
    STATS["retracted"] += eng.scheduler.num_preemptions
    if eng.speculator is not None:
        STATS["drafts_accepted"] += eng.speculator.stats.accepted
    for spec, prompt, params, reqs in added:
        assert not any(r.finish_reason is FinishReason.ERROR for r in reqs), [r.error for r in reqs]
        if any(r.finish_reason is FinishReason.ABORT for r in reqs):
            STATS["aborted"] += 1
            continue
        assert [r.output_token_ids for r in reqs] == reference(prompt, params), spec


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(specs=st.lists(REQUEST, min_size=2, max_size=7))
def test_fuzzed_prefix_hits_give_each_request_its_cold_tokens(qwen, reference, specs):
    """The prefix cache on, checkpoints every 8 tokens and at prompt ends into room for
    40 (a request of 150 tokens takes 20): requests sharing prefixes of every length hit
    the deepest checkpoint left and get their cold tokens."""
    eng = engine(qwen, pages=100, checkpoints=40)
    alloc = eng.cache.state.checkpoints
    taken = 0
    real = alloc.alloc

    def counting(n):
        nonlocal taken
        taken += n
        return real(n)
    alloc.alloc = counting
    for i, spec in enumerate(specs):
        prompt, params = prompt_of(spec, i), params_of(spec, seed=i)
        for again in (False, True):  # the second run hits the first's prompt-end checkpoint
            reqs = eng.add_request(prompt, params)
            drive(eng, check_integrity=True)
            STATS["cached_tokens"] += sum(r.num_cached_tokens for r in reqs)
            assert [r.output_token_ids for r in reqs] == reference(prompt, params), spec
            assert not again or len(prompt) < 5 or reqs[0].num_cached_tokens > 0
    STATS["checkpoints_dropped"] += max(0, taken - alloc.num_pages)
    check_pool_returns(eng)
