"""Overlap scheduling: the next step is scheduled and prepared while the current one
computes, and chains only when that cannot change anything, so outputs are the same with
and without it (greedy, seeded, grammar rows, stops, n > 1, retraction)."""

from __future__ import annotations

import pytest

from swaserve import LLM, SamplingParams
from swaserve.engine import scheduler
from swaserve.engine.engine import Engine
from tests.conftest import TEST_DEVICE, drive

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def mixed_workload(vocab: int) -> list[tuple[str | list[int], SamplingParams]]:
    """Free rows (greedy, seeded, filtered, early stops on a common token), grammar rows,
    stop strings, penalties, n = 2 and a prompt long enough to be chunked."""
    work = []
    for i in range(12):
        prompt = [3 + (i * 37 + j * 11) % (vocab - 3) for j in range(5 + 9 * i)]
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=20 + i, stop_token_ids=[7, 9])
        elif kind == 1:
            p = SamplingParams(temperature=0.9, seed=i, top_k=30, top_p=0.9, max_tokens=24)
        elif kind == 2:
            p = SamplingParams(temperature=0, max_tokens=40, json_schema=SCHEMA)
        elif kind == 3:
            p = SamplingParams(temperature=1.0, seed=i, max_tokens=30, stop=["a", "e"])
        elif kind == 4:
            p = SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=16, frequency_penalty=0.5)
        else:
            p = SamplingParams(temperature=1.0, seed=i, max_tokens=25, regex=r"[a-z]{3,12}")
        work.append((prompt, p))
    return work


def run(path: str, overlap: bool, **kw) -> tuple[list[list[list[int]]], int]:
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, overlap=overlap, **kw)
    eng = llm.engine
    work = mixed_workload(eng.vocab_size)
    groups = [eng.add_request(prompt, p) for prompt, p in work]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        steps += 1
        if steps == 3:  # a late arrival joins while a step is in flight
            groups.append(eng.add_request(work[0][0], work[0][1]))
    assert eng.cache.is_fully_free()
    return [[r.output_token_ids for r in g] for g in groups], eng.scheduler.num_preemptions


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 16, "kv_memory": "160KiB",
                                      "max_running_requests": 5, "page_size": 8}])
def test_overlap_on_and_off_give_identical_outputs(tiny_with_tokenizer, kw, monkeypatch):
    # admission without a growth estimate, so that the small pool really retracts
    monkeypatch.setattr(scheduler, "RATIO_INIT", 0.0)
    monkeypatch.setattr(scheduler, "RATIO_MIN", 0.0)
    off, preempted_off = run(tiny_with_tokenizer, False, **kw)
    on, preempted_on = run(tiny_with_tokenizer, True, **kw)
    assert on == off
    assert sum(len(t) for g in on for t in g) > 200
    if kw:  # the small pool really retracts, with overlap too
        assert preempted_off > 0 and preempted_on > 0


def test_free_rows_chain_and_grammar_rows_do_not(tiny_with_tokenizer):
    eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, overlap=True)
    eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()  # prefill, read back; the first decode is already launched behind it
    eng.step()
    assert eng.step_in_flight is not None and eng.step_in_flight.chain_safe
    eng.add_request([8, 9], SamplingParams(temperature=0, max_tokens=8, json_schema=SCHEMA))
    drive(eng, until=lambda: eng.step_in_flight is not None and any(
        r.grammar is not None for _, r in eng.step_in_flight.owners))
    assert not eng.step_in_flight.chain_safe
    eng.settle()
    drive(eng)
    assert eng.cache.is_fully_free()


def test_stop_while_next_step_computes_frees_memory_after_it(tiny_with_tokenizer):
    """A row that stops on a token read while the next step already computes it: that
    surplus token is dropped and its memory outlives the step, not the other way round."""
    eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE,
                 prefix_cache=False, overlap=True)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, overlap=False).generate(
        [5, 6, 7], plain)[0].token_ids
    stop_at = first[4]
    req = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30,
                                                    stop_token_ids=[stop_at]))[0]
    drive(eng, until=lambda: req.is_finished)
    assert req.output_token_ids == first[:first.index(stop_at) + 1]
    assert eng.step_in_flight is not None and req.row is not None  # held by the step in flight
    eng.check_integrity()
    eng.settle()
    assert req.row is None and eng.cache.is_fully_free()


def test_overlap_is_off_by_default_on_a_cpu_and_on_when_asked(tiny_with_tokenizer):
    """On a CPU the forward keeps every core busy and host work beside it only slows it
    (benchmarks/README.md): off unless asked for."""
    assert LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE).engine.overlap is False
    eng = LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, overlap=True).engine
    eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert eng.overlap and eng.step_in_flight is not None  # the next step computes already
