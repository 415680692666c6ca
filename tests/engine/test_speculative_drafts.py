"""Which drafts speculative decoding makes: the cost gate measures first and pauses
drafts that do not pay, the n-gram index proposes the longest suffix's latest
continuation within a bounded lookback, and no draft runs past what the request may
still write, into a request that opted out, or over a cached prefix."""

from __future__ import annotations

import pytest

from swaserve.engine import speculative
from swaserve.engine.speculative import CostGate, NgramIndex
from swaserve.sampling.params import SamplingParams
from tests.conftest import drive
from tests.engine.conftest import spec_engine

pytest.importorskip("llguidance")


def test_cost_gate_measures_first_and_pauses_drafts_that_do_not_pay():
    gate = CostGate()
    for _ in range(speculative.GATE_SAMPLES):  # first the cost without drafts
        assert not gate.allow(8)
        gate.observe(8, False, 0.08, 8)  # 10 ms a token
    assert gate.allow(8) and not gate.allow(1)  # sizes are apart
    for _ in range(speculative.GATE_SAMPLES):  # drafts at 5 ms a token: they pay
        gate.observe(8, True, 0.08, 16)
    assert gate.allow(7)  # 5-8 share a bucket
    for _ in range(20):  # now 12 ms a token: pause 16 steps
        gate.observe(8, True, 0.12, 10)
        if not gate.allow(8):
            break
    assert sum(not gate.allow(8) for _ in range(16)) == 15 and gate.allow(8)
    for _ in range(speculative.GATE_REFRESH):
        gate.observe(8, True, 0.05, 10)
    assert not gate.allow(8)  # a step without drafts refreshes the comparison
    gate.observe(8, False, 0.08, 8)
    assert gate.allow(8)


class _Req:
    def __init__(self, prompt, output=()):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def test_ngram_index_takes_the_longest_suffix_and_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    # "5 6 7" occurs twice, followed by 8 9 then by 1 2; the longest suffix is "5 6 7"
    req = _Req([5, 6, 7, 8, 9, 4, 5, 6, 7, 1, 2, 3, 0, 6, 7])
    idx.extend(req)
    assert idx.propose(2) == [1, 2]  # "6 7": its latest occurrence before the end
    req.output_token_ids.append(9)
    idx.extend(req)
    assert idx.propose(3) == [4, 5, 6]  # "7 9" never occurred before, "9" did
    req.output_token_ids += [5, 6, 7]
    idx.extend(req)
    assert idx.propose(3) == [1, 2, 3]  # "5 6 7" (n = 3) again
    assert NgramIndex(2, 3).propose(4) == []  # nothing yet


def test_ngram_index_continues_a_repeat_shorter_than_the_draft():
    idx = NgramIndex(2, 4)
    idx.extend(_Req([1, 2, 3, 1, 2, 3, 1, 2]))
    assert idx.propose(7) == [3, 1, 2, 3, 1, 2, 3]
    idx2 = NgramIndex(2, 2)
    idx2.extend(_Req([4, 4, 4]))
    assert idx2.propose(5) == [4] * 5


def test_no_draft_is_longer_than_what_the_request_may_still_write(tiny_hybrid):
    eng = spec_engine(tiny_hybrid[0], speculative="ngram", num_draft_tokens=8,
                      max_model_len=64)
    rep = [4, 5, 6] * 10
    a = eng.add_request(rep, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    b = eng.add_request(rep, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]

    def within_bounds(eng):
        for r in (a, b):
            assert r.num_tokens <= r.max_total_tokens
    drive(eng, check_integrity=True, each_step=within_bounds)
    assert len(a.output_token_ids) == 7 and len(b.output_token_ids) == 64 - 30
    assert eng.speculator.stats.accepted > 0


def test_a_request_can_opt_out_and_unseeded_ones_draw_a_seed(tiny_hybrid):
    eng = spec_engine(tiny_hybrid[0], speculative="ngram")
    rep = [4, 5, 6] * 10
    out = eng.add_request(rep, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              speculative=False))[0]
    free = eng.add_request(rep, SamplingParams(temperature=1.0, max_tokens=20, n=2))
    assert out.seed is None and all(r.seed is not None for r in free)
    assert free[0].seed != free[1].seed
    drive(eng)
    assert out.request_id not in eng.speculator.stats.states
    assert len(out.output_token_ids) == 20
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


def test_the_index_reads_a_bounded_lookback(monkeypatch):
    monkeypatch.setattr(speculative, "LOOKBACK", 10)
    idx = NgramIndex(2, 2)
    idx.extend(_Req([7, 8, 9] + [1] * 20 + [5, 6, 3, 5, 6]))
    assert idx.propose(2) == [3, 5]  # "5 6" 3 tokens back: inside the lookback
    assert sum(map(len, idx.ends.values())) <= 10
    far = NgramIndex(2, 2)
    far.extend(_Req([5, 6, 4] + [1] * 20 + [5, 6]))
    assert far.propose(2) == []  # its only earlier "5 6" lies beyond it


def test_a_draft_never_evicts_a_cached_prefix(tiny_hybrid):
    eng = spec_engine(tiny_hybrid[0], speculative="ngram", window_cache_memory="16KiB")
    first = eng.add_request([4, 5, 6] * 8, SamplingParams(temperature=0, max_tokens=4))[0]
    drive(eng)
    req = eng.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=40))[0]
    eng.step()  # its prompt: one page, its first token
    alloc = eng.cache.window_pages.allocator
    alloc.alloc(alloc.num_free)  # no window page free: a new one would evict the prefix
    nodes, page = eng.cache.prefix.num_nodes, eng.cache.page_size
    assert first.is_finished and nodes > 0 and req.num_computed_tokens == page - 1
    batch = eng.scheduler.schedule(drafts={req.request_id: [9] * 4},
                                   max_decode_rows=eng.loop._max_decode_rows)
    assert [s.draft for s in batch.seqs] == [[]]  # past its page it would need a new one
    assert eng.cache.prefix.num_nodes == nodes
