"""Speculative decoding (engine/speculative.py): the output is token for token the
non-speculative output, for every sampling feature (stops, grammars, text, logprobs),
through retraction, prefix hits, overlap, batch-invariant mode and int8 fused decode,
in the server, and when a request or the speculator fails. Which drafts are made:
test_speculative_drafts.py; the cache they leave: test_speculative_cache.py."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8
from swaserve.sampling.params import SamplingParams
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, random_prompt, use_int8_copies
from tests.engine.conftest import spec_engine

pytest.importorskip("llguidance")


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


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_keeps_the_output(tiny_hybrid, kv):
    path = tiny_hybrid[0]
    work = workload(128, structured=False)
    work.append((work[0][0] + [9, 9, 4], SamplingParams(temperature=0, max_tokens=20)))
    off, _, _ = run(path, None, work, kv_cache_dtype=kv)
    for kw in ({}, {"chunk_size": 16, "kv_memory": "160KiB", "max_running_requests": 5,
                    "page_size": 8}):
        on, stats, _ = run(path, "ngram", work, kv_cache_dtype=kv, **kw)
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
