"""Speculative decoding (engine/speculative.py): the output is token for token the
non-speculative output, for every sampling feature, and the cache after any pattern of
accepted and rejected drafts holds what a non-speculative run holds at the same position."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve.engine import speculative
from swaserve.engine.speculative import CostGate, NgramIndex
from swaserve.kernels import q8
from swaserve.sampling.params import SamplingParams
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, random_prompt, tiny_engine, use_int8_copies

pytest.importorskip("llguidance")


def spec_engine(path, **kw):
    """tiny_engine whose drafts are not gated by timings (CostGate is tested on its own:
    a tiny model's step times are noise)."""
    eng = tiny_engine(path, **kw)
    if eng.speculator is not None:
        eng.speculator.gate.allow = lambda n: True
    return eng


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


def workload(vocab: int, structured: bool) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat (drafts get accepted) and ones that do not, with every sampling
    feature a draft must respect."""
    rep = [3 + (j * 7) % 11 for j in range(6)] * 6  # a period-6 text, longer than 3W
    work = [
        (rep, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        (rep[:20], SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)),
        (rep[5:30], SamplingParams(temperature=0.9, seed=4, top_k=20, top_p=0.9, min_p=0.05,
                                   max_tokens=30, ignore_eos=True, logprobs=3)),
        (rep, SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.4,
                             presence_penalty=0.2, ignore_eos=True)),
        (rep[:25], SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3,
                                  logit_bias={7: 2.0, 9: -50.0}, max_tokens=24)),
        (random_prompt(3 * W + 5, 1, vocab), SamplingParams(temperature=0, max_tokens=30,
                                                            min_tokens=10, stop_token_ids=[5])),
        (random_prompt(9, 2, vocab), SamplingParams(temperature=0.6, seed=6, n=2, max_tokens=20)),
        (rep, SamplingParams(temperature=0, max_tokens=33, logprobs=2, ignore_eos=True)),
    ]
    if structured:
        work += [
            (rep[:12], SamplingParams(temperature=0, max_tokens=30, stop=["a", "}"])),
            (rep[:12], SamplingParams(temperature=0.8, seed=8, max_tokens=40, regex=r"(ab|cd){2,9}")),
            (rep[:14], SamplingParams(temperature=0, max_tokens=60, json_schema={
                "type": "object", "properties": {"a": {"type": "integer"}},
                "required": ["a"], "additionalProperties": False})),
        ]
    return work


def run(path, spec: str | None, work, late: int = 3, **kw):
    """Every request's (tokens, logprobs, finish reason); and the speculator's stats."""
    eng = spec_engine(path, speculative=spec, **kw)
    groups, steps = [], 0
    pending = list(work)
    while pending or eng.has_unfinished():
        if pending and (steps % late == 0):  # arrivals while others decode
            groups.append(eng.add_request(*pending.pop(0)))
        eng.step()
        eng.check_integrity()
        steps += 1
    eng.settle()
    assert eng.cache.is_fully_free()
    out = [[(r.output_token_ids, r.logprobs, r.finish_reason, r.output_text) for r in g]
           for g in groups]
    return out, eng.speculator.stats if eng.speculator else None, steps


def assert_same(a, b) -> None:
    for ga, gb in zip(a, b, strict=True):
        for (ta, la, fa, xa), (tb, lb, fb, xb) in zip(ga, gb, strict=True):
            assert ta == tb and fa == fb and xa == xb
            if la is not None:
                for ea, eb in zip(la, lb, strict=True):
                    assert ea.keys() == eb.keys()
                    assert all(abs(ea[t] - eb[t]) < 1e-5 for t in ea)


@pytest.mark.parametrize("model", ["tiny_hybrid", "tiny_all_sliding", "tiny_no_sliding"])
@pytest.mark.parametrize("kw", [{}, {"chunk_size": 7}, {"num_draft_tokens": 2, "ngram_min": 1}])
def test_output_is_the_non_speculative_output(request, model, kw):
    path = request.getfixturevalue(model)[0]
    work = workload(128, structured=False)
    off, _, _ = run(path, None, work, **kw)
    on, stats, _ = run(path, "ngram", work, **kw)
    assert_same(off, on)
    assert stats.accepted > 0


def test_stops_grammars_and_text_are_the_non_speculative_ones(tiny_with_tokenizer):
    work = workload(300, structured=True)
    off, _, _ = run(tiny_with_tokenizer, None, work)
    on, stats, _ = run(tiny_with_tokenizer, "ngram", work)
    assert_same(off, on)
    grammar_rows = [stats.states[f"req-{i}"] for i in (9, 10)]  # the regex and the schema
    assert all(st.accepted > 0 for st in grammar_rows)


def test_retraction_prefix_hits_and_overlap_keep_the_output(tiny_hybrid):
    path = tiny_hybrid[0]
    work = workload(128, structured=False)
    work.append((work[0][0] + [9, 9, 4], SamplingParams(temperature=0, max_tokens=20)))
    small = {"chunk_size": 16, "kv_memory": "160KiB", "max_running_requests": 5, "page_size": 8}
    off, _, _ = run(path, None, work, **small)
    for kw in (small, {"overlap": True}, {"prefix_cache": False}):
        on, stats, _ = run(path, "ngram", work, **kw)
        assert_same(off, on)
        assert stats.accepted > 0


def test_batch_invariant_mode_takes_drafts_too(tiny_hybrid):
    work = workload(128, structured=False)[:4]
    off, _, _ = run(tiny_hybrid[0], None, work, batch_invariant=True)
    on, stats, _ = run(tiny_hybrid[0], "ngram", work, batch_invariant=True)
    assert_same(off, on)
    assert stats.accepted > 0


@pytest.mark.cpu_only
@pytest.mark.skipif(not (q8.vnni_available() or q8.amx_available()),
                    reason="no int8 tile kernel here")
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_int8_fused_decode_verifies_drafts_with_the_bits_of_plain_decode(tiny_hybrid, batch):
    """bf16 with int8 weights: the drafted rows go through the fused decode call, and the
    rows are capped so that every step keeps the int8 kernel it would have taken anyway,
    so the output is the same bits, not only the same up to round-off. (The prompts are
    prefilled in one step: a decode row that shares a step with a prompt chunk takes the
    prompt's kernel, with or without drafts. Past VNNI_ROWS requests a row's kernel
    depends on how many others decode beside it, drafts or not; batch-invariant mode
    holds bits whatever the batch.)"""
    rep = [3 + (j * 5) % 13 for j in range(7)] * 5
    work = [(rep[i:] + [i + 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            for i in range(batch)]
    outs = []
    for spec in (None, "ngram"):
        eng = spec_engine(tiny_hybrid[0], dtype="bfloat16", prefix_cache=False,
                          speculative=spec, chunk_size=512, max_running_requests=16)
        use_int8_copies(eng)
        eng.logits_log = []
        reqs = [eng.add_request(*w)[0] for w in work]
        drive(eng)
        outs.append(([r.output_token_ids for r in reqs], eng))
    (a, off), (b, on) = outs
    assert a == b
    assert on.speculator.stats.accepted > 0 and on.model.fused_decode_steps > 0
    logged = {}
    for rid, pos, lg in off.logits_log:
        logged[(rid, pos)] = lg
    # each position's kept row is bit for bit the plain one
    for rid, pos, lg in on.logits_log:
        ref = logged.get((rid, pos))
        if ref is not None and torch.equal(ref, lg):
            logged.pop((rid, pos))
    assert not logged, f"{len(logged)} positions without a bitwise-equal row"


class ScriptedDrafts:
    """Drafts from the reference output, corrupted at random places: every pattern of
    accepted and rejected tokens."""

    def __init__(self, speculator, reference: dict[str, list[int]], seed: int):
        self.rng = random.Random(seed)
        self.reference = reference
        speculator.drafts = self

    def __call__(self, running):
        out = {}
        for req in running:
            if req.num_uncomputed_tokens != 1 or not req.output_token_ids:
                continue
            ref = self.reference[req.request_id][req.num_output_tokens:]
            k = self.rng.randint(0, 5)
            draft = list(ref[:k])
            if draft and self.rng.random() < 0.6:
                at = self.rng.randrange(len(draft))
                draft[at] = (draft[at] + 1 + self.rng.randrange(100)) % 128
            if draft:
                out[req.request_id] = draft
        return out


def kv_of(eng, req) -> dict[tuple[str, int, int], torch.Tensor]:
    """(kind, layer, position) -> [K|V] of what a row holds: every full-pool position it has
    computed, the ring's positions inside the window, and its window-page positions."""
    cache, row, n = eng.cache, req.row, req.num_computed_tokens
    out = {}
    if cache.full is not None:
        for d, (k, v) in enumerate(zip(cache.full.k, cache.full.v)):
            slots = cache.rows.req_to_token[row, :n]
            for p in range(n):
                out[("full", d, p)] = torch.cat([k[slots[p]], v[slots[p]]])
    if cache.window is not None:
        ring = cache.window.ring
        held = cache.window.positions[row * ring:(row + 1) * ring]
        assert not (held >= n).any(), "a ring slot claims a position not computed"
        for p in range(max(0, n - W), n):
            slot = row * ring + p % ring
            assert int(cache.window.positions[slot]) == p
            for d, (k, v) in enumerate(zip(cache.window.k, cache.window.v)):
                out[("ring", d, p)] = torch.cat([k[slot], v[slot]])
    if cache.window_pages is not None:
        pages, ps = cache.row_window_pages[row], cache.page_size
        for p in range(n):
            w = pages[p // ps] if p // ps < len(pages) else None
            if w is not None:
                for d, (k, v) in enumerate(zip(cache.window_pages.k, cache.window_pages.v)):
                    out[("page", d, p)] = torch.cat([k[w * ps + p % ps], v[w * ps + p % ps]])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_after_random_accepts_and_rejects_is_the_non_speculative_cache(tiny_hybrid, seed):
    path = tiny_hybrid[0]
    prompts = [random_prompt(3 * W + 3 + 5 * i, 10 + i) for i in range(3)]
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=3 * W + 4, ignore_eos=True)
    # the reference: no drafts; the KV of each position as each step leaves it
    ref_eng = tiny_engine(path)
    reqs = [ref_eng.add_request(p, params)[0] for p in prompts]
    ref_kv: dict[str, dict] = {r.request_id: {} for r in reqs}
    while ref_eng.has_unfinished():
        ref_eng.step()
        for r in reqs:
            if r.row is not None:
                ref_kv[r.request_id].update(kv_of(ref_eng, r))
    reference = {r.request_id: r.output_token_ids for r in reqs}

    eng = spec_engine(path, speculative="ngram")
    scripted = ScriptedDrafts(eng.speculator, reference, seed)
    reqs = [eng.add_request(p, params)[0] for p in prompts]
    checked = rejected = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        for r in reqs:
            if r.row is None:
                continue
            held = len(eng.cache.row_pages[r.row])
            assert held <= -(-(r.num_computed_tokens + 1) // eng.cache.page_size)
            for (kind, d, p), kv in kv_of(eng, r).items():
                # a ring holds what the window pages hold (the reference's are complete;
                # its ring was seen only at the ends of its steps)
                ref = ref_kv[r.request_id][("page" if kind == "ring" else kind, d, p)]
                torch.testing.assert_close(kv, ref, rtol=1e-4, atol=1e-5)
                checked += 1
    stats = eng.speculator.stats
    rejected = stats.proposed - stats.accepted
    assert [r.output_token_ids for r in reqs] == list(reference.values())
    assert stats.accepted > 10 and rejected > 10 and checked > 1000
    assert scripted.rng is not None and eng.cache.is_fully_free()


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


def test_a_fault_in_a_drafted_request_fails_it_alone(tiny_with_tokenizer):
    work = workload(300, structured=True)
    off, _, _ = run(tiny_with_tokenizer, None, work, late=1)
    eng = spec_engine(tiny_with_tokenizer, speculative="ngram")
    groups = [eng.add_request(*w) for w in work]
    victim = groups[9][0]  # a regex row with drafts
    states = eng.speculator.stats.states
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        if victim.request_id in states and states[victim.request_id].proposed:
            eng.faults.arm("grammar", victim.request_id)  # once it has drafted
    assert victim.finish_reason.value == "error" and states[victim.request_id].proposed
    for i, (g, ref) in enumerate(zip(groups, off)):
        if i != 9:
            assert [r.output_token_ids for r in g] == [t for t, *_ in ref]
    assert eng.cache.is_fully_free()


@pytest.fixture(scope="module")
def spec_app(tiny_with_tokenizer):
    from tests.conftest import inprocess_app

    yield from inprocess_app(tiny_with_tokenizer, speculative="ngram", kv_memory="16MiB")


def test_the_server_speculates_and_a_request_may_opt_out(spec_app, tiny_with_tokenizer):
    from tests.conftest import run_client

    prompt = "abc abc abc abc abc abc abc abc"

    async def go(client, http):
        outs = []
        for extra in ({}, {"speculative": False}):
            r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                                temperature=0, extra_body=extra)
            outs.append(r.choices[0].text)
        chunks = [c.choices[0].text async for c in await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)]
        bad = await http.post("/v1/completions", json={"prompt": prompt, "speculative": "on"})
        metrics = (await http.get("/metrics")).text
        return outs, "".join(chunks), bad, metrics

    (spec, plain), streamed, bad, metrics = run_client(spec_app, go)
    assert spec == plain == streamed
    assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("swaserve_spec_")}
    assert 0 < counts["swaserve_spec_accepted_tokens_total"] <= counts[
        "swaserve_spec_draft_tokens_total"]


def test_a_speculator_that_raises_costs_its_drafts_only(tiny_hybrid):
    work = workload(128, structured=False)[:4]
    off, _, _ = run(tiny_hybrid[0], None, work)
    eng = spec_engine(tiny_hybrid[0], speculative="ngram")

    def broken(running):
        raise RuntimeError("a bug in the draft proposer")

    eng.speculator.drafts = broken
    groups = [eng.add_request(*w) for w in work]
    drive(eng)
    assert [[r.output_token_ids for r in g] for g in groups] == [[t for t, *_ in g] for g in off]
    assert all(r.finish_reason.value != "error" for g in groups for r in g)


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
                                   max_decode_rows=eng._max_decode_rows)
    assert [s.draft for s in batch.seqs] == [[]]  # past its page it would need a new one
    assert eng.cache.prefix.num_nodes == nodes
