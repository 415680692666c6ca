"""Workloads fuzzed through the whole engine: hypothesis draws requests (prompts that share
prefixes or not, shorter and longer than the window; greedy and seeded rows with every
filter and penalty; n > 1; stop tokens; arrivals over the first steps; aborts) onto a pool
small enough to evict prefixes and retract requests. Every request ends; the pool checks
its integrity after each step and returns whole at the end; and every request that was
not aborted gets the tokens it gets alone on an engine without a prefix cache or drafts:
sharing a step, a prefix, a retraction, n-gram drafts or a neighbour's abort changes
nothing. Bounded: a fixed number of derandomized examples on the tiny hybrid model
(W = 8), ~65 s in all."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.engine.request import FinishReason
from swaserve.sampling.params import SamplingParams
from tests.conftest import drive, random_prompt, tiny_engine

EXAMPLES = 25
# steps without a new token or a finished request: a hang (a retracted request recomputes
# its <= 150 tokens in chunks of 16, 10 steps, before it samples again)
STALL_STEPS = 64

REQUEST = st.fixed_dictionaries({
    "base": st.integers(0, 2),  # which shared prefix the prompt starts with
    "shared": st.sampled_from([0, 3, 8, 13, 30]),  # how much of it (W = 8)
    "own": st.integers(1, 20),
    "kind": st.sampled_from(["greedy", "seeded", "top_p", "top_k", "min_p", "penalties"]),
    "max_tokens": st.one_of(st.integers(1, 16), st.sampled_from([64, 100])),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([1, 1, 1, 2]),
    "stop_token": st.sampled_from([None, None, 40, 77]),
    "arrive": st.integers(0, 6),
    "abort_at": st.sampled_from([None, None, None, 2, 5, 9]),
})
KINDS = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9},
    "top_p": {"temperature": 1.0, "top_p": 0.8},
    "top_k": {"temperature": 0.7, "top_k": 5},
    "min_p": {"temperature": 1.3, "min_p": 0.1},
    "penalties": {"temperature": 0.8, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.2, "logit_bias": {5: 2.0}},
}
STATS = {"retracted": 0, "aborted": 0, "compared": 0, "cached_tokens": 0, "drafts_accepted": 0}


def params_of(spec: dict, seed: int) -> SamplingParams:
    stop = [spec["stop_token"]] if spec["stop_token"] is not None else None
    return SamplingParams(**KINDS[spec["kind"]], seed=seed, n=spec["n"],
                          max_tokens=spec["max_tokens"], stop_token_ids=stop,
                          ignore_eos=spec["ignore_eos"])


def prompt_of(spec: dict, i: int) -> list[int]:
    return random_prompt(30, 1000 + spec["base"])[:spec["shared"]] + random_prompt(spec["own"], i)


ROW_BYTES, PAGE_BYTES = 16576, 1024  # the tiny model's rings for chunks of 16, a page


def engine(path, pages: int = 40, **kw):
    """4 rows and `pages` of 4 tokens' KV (the prefix cache's window pages take a share):
    a few requests at once, and those that grow past the pool retract."""
    return tiny_engine(path, kv_memory=4 * ROW_BYTES + pages * PAGE_BYTES,
                       max_running_requests=4, page_size=4, chunk_size=16, **kw)


def run_alone(eng, prompt: list[int], params: SamplingParams) -> list:
    reqs = eng.add_request(prompt, params)
    drive(eng)
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_hybrid):
    """Tokens of one request run alone and cold (memoised over the module's examples); at
    teardown, that the examples reached what they are for."""
    path, _ = tiny_hybrid
    eng = engine(path, prefix_cache=False, batch_invariant=True)
    seen: dict = {}

    def tokens(prompt: list[int], params: SamplingParams) -> list[list[int]]:
        key = (tuple(prompt), repr(params))
        if key not in seen:
            seen[key] = [r.output_token_ids for r in run_alone(eng, prompt, params)]
        STATS["compared"] += 1
        return seen[key]
    yield tokens
    assert STATS["retracted"] >= 5 and STATS["aborted"] >= 5, STATS
    assert STATS["drafts_accepted"] >= 50, STATS
    assert STATS["compared"] >= 100 and STATS["cached_tokens"] >= 200, STATS


def check_pool_returns(eng) -> None:
    eng.check_integrity()
    eng.cache.evict_all()  # what the prefix cache still holds: then nothing is held
    assert eng.cache.full.allocator.num_free == eng.cache.num_total_pages
    if eng.cache.window_pages is not None:
        wp = eng.cache.window_pages.allocator
        assert wp.num_free == wp.num_pages


@pytest.mark.parametrize("speculative", [None, "ngram"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(specs=st.lists(REQUEST, min_size=1, max_size=10))
def test_fuzzed_workloads_give_every_request_its_tokens_alone(tiny_hybrid, reference,
                                                              speculative, specs):
    """Batch-invariant mode (float32, so that a row's bits do not depend on how many share
    its step, which turns the prefix cache off): requests arrive over the first steps, share
    steps, retract when the pool runs out, are aborted; with n-gram drafts or not (each
    one verified, the gate that times them open); each one that is not aborted gets its
    tokens alone without drafts."""
    path, _ = tiny_hybrid
    eng = engine(path, batch_invariant=True, speculative=speculative)
    assert eng.cache.num_total_pages == 40
    if eng.speculator is not None:  # a tiny model's step times are noise: draft always
        eng.speculator.gate.allow = lambda n: True
    added: list[tuple[dict, list[int], SamplingParams, list]] = []
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
        assert step - last_progress <= STALL_STEPS, (
            f"no request gained a token or finished in {STALL_STEPS} steps: "
            f"{[(r.request_id, r.status.name, r.num_output_tokens) for r in reqs]}")
    check_pool_returns(eng)
    STATS["retracted"] += eng.scheduler.num_preemptions
    if eng.speculator is not None:
        STATS["drafts_accepted"] += eng.speculator.stats.accepted
    for spec, prompt, params, reqs in added:
        assert all(r.is_finished for r in reqs)
        assert not any(r.finish_reason is FinishReason.ERROR for r in reqs), [r.error for r in reqs]
        if any(r.finish_reason is FinishReason.ABORT for r in reqs):
            STATS["aborted"] += 1
            continue
        assert [r.output_token_ids for r in reqs] == reference(prompt, params), spec


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(specs=st.lists(REQUEST, min_size=2, max_size=10))
def test_fuzzed_prefix_hits_give_each_request_its_cold_tokens(tiny_hybrid, reference, specs):
    """The prefix cache on (float32, one request at a time, so that each step holds one
    row as the cold run's does): requests that share prefixes of every length around the
    window, on a pool that evicts them, get their cold tokens."""
    path, _ = tiny_hybrid
    eng = engine(path, pages=100)  # 68 full-KV pages, and 16 window pages for the cache
    for i, spec in enumerate(specs):
        prompt, params = prompt_of(spec, i), params_of(spec, seed=i)
        reqs = run_alone(eng, prompt, params)
        eng.check_integrity()
        STATS["cached_tokens"] += sum(r.num_cached_tokens for r in reqs)
        assert [r.output_token_ids for r in reqs] == reference(prompt, params), spec
    check_pool_returns(eng)
