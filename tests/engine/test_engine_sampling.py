"""Sampling through the engine on a tiny model: n > 1 shares the prompt, seeds per child."""

from __future__ import annotations

from swaserve import LLM, SamplingParams
from tests.conftest import TEST_DEVICE, drive, random_prompt


def test_n_completions_share_prompt_and_follow_seed_streams(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="64MiB", max_running_requests=8,
              page_size=4)
    prompt = random_prompt(30, seed=4)  # 30 = 7 whole pages + a partial one (copied)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, n=3, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 3
    for i, c in enumerate(out.outputs):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, top_k=20, seed=11 + i,
                                                       max_tokens=12, ignore_eos=True))[0]
        assert c.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.cache.is_fully_free()
    llm.engine.check_integrity()


def test_fork_shares_whole_pages(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="64MiB", max_running_requests=8,
              page_size=4)
    eng = llm.engine
    reqs = eng.add_request(random_prompt(30, seed=5),
                           SamplingParams(temperature=0, n=2, max_tokens=5, ignore_eos=True))
    drive(eng, until=lambda: reqs[1].row is not None)
    a, b = (eng.cache.row_pages[r.row] for r in reqs)
    assert a[:7] == b[:7] and a[7] != b[7]  # whole pages shared, the partial one copied
    # two rows and the prefix cache (the prompt was cached when it completed)
    assert all(eng.cache.full.allocator.refcount[p] == 3 for p in a[:7])
    eng.check_integrity()
    drive(eng)
    assert reqs[0].output_token_ids == reqs[1].output_token_ids  # greedy: identical
    assert eng.cache.is_fully_free()


def test_logprobs_and_min_tokens(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="64MiB", max_running_requests=4)
    out = llm.generate([random_prompt(9, 1)], SamplingParams(temperature=0, max_tokens=6,
                                                            logprobs=3, min_tokens=6,
                                                            stop_token_ids=[5, 6]))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 6 and not set(c.token_ids) & {1, 5, 6}
    assert len(c.logprobs) == 6
    for t, entry in zip(c.token_ids, c.logprobs):
        assert t in entry and len(entry) >= 3 and all(v <= 0 for v in entry.values())


def test_a_sibling_that_cannot_fork_ends_where_its_first_token_ends_it(tiny_hybrid):
    """An n > 1 sibling with no row to fork into waits to prefill on its own, its first
    token already sampled from the parent's prompt. When that token ends it (max_tokens 1,
    a stop token) it must leave the queue finished: it stayed in it, was admitted again
    and wrote a second token past max_tokens (found by tests/engine/test_engine_fuzz.py)."""
    from tests.conftest import tiny_engine

    path, _ = tiny_hybrid
    prompt = random_prompt(12, seed=1)
    ref = tiny_engine(path)
    first = ref.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    drive(ref)
    for kw in ({"max_tokens": 1}, {"max_tokens": 6, "stop_token_ids": first.output_token_ids}):
        eng = tiny_engine(path, max_running_requests=1)  # one row: the sibling cannot fork
        reqs = eng.add_request(prompt, SamplingParams(temperature=0, n=2, ignore_eos=True, **kw))
        drive(eng, max_steps=19, check_integrity=True)
        assert [r.output_token_ids for r in reqs] == [first.output_token_ids] * 2, kw
        assert eng.cache.is_fully_free()
