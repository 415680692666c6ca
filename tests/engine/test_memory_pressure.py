"""No request starves under memory pressure: on a full pool that holds one or two long
requests, every request of a crowd finishes, in bounded steps, each retracted a bounded
number of times, with the greedy tokens it gets alone."""

from __future__ import annotations

import pytest

from swaserve.engine.request import FinishReason
from swaserve.engine.scheduler import MAX_RETRACTIONS
from swaserve.sampling.params import SamplingParams
from tests.conftest import drive, random_prompt, tiny_engine

PROMPT, NEW = 120, 24
ROW_BYTES, PAGE_BYTES = 33216, 1024  # the tiny model's rings per row, one full-KV page


def crowd_engine(path, pages: int = 80, **kw):
    """8 rows and `pages` full-KV pages of 4 tokens: 80 hold two 120 + 24 requests."""
    eng = tiny_engine(path, kv_memory=8 * ROW_BYTES + pages * PAGE_BYTES,
                      max_running_requests=8, page_size=4, chunk_size=48, prefix_cache=False,
                      **kw)
    assert eng.cache.num_total_pages == pages
    return eng


def run_arrivals(eng, arrivals: dict[int, list[tuple[list[int], SamplingParams]]], max_steps: int):
    reqs, steps = [], 0
    while steps == 0 or eng.has_unfinished() or any(s >= steps for s in arrivals):
        for prompt, p in arrivals.get(steps, []):
            reqs += eng.add_request(prompt, p)
        eng.step()
        eng.check_integrity()
        steps += 1
        assert steps <= max_steps, (f"not done after {steps} steps: "
                                    f"{sum(not r.is_finished for r in reqs)} unfinished")
    return reqs, steps


@pytest.mark.parametrize("stagger", [0, 3])
@pytest.mark.parametrize("prompt_len, new, pages", [
    (PROMPT, NEW, 80),  # long prompts: two fit
    (40, 100, 64),  # long outputs: the admission estimate is too low, so requests retract
])
def test_every_request_of_a_crowd_finishes(tiny_hybrid, stagger, prompt_len, new, pages):
    path, _ = tiny_hybrid
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    prompts = [random_prompt(prompt_len, 100 + i) for i in range(16)]
    eng = crowd_engine(path, pages)
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):  # all at once, or one every `stagger` steps
        arrivals.setdefault(i * stagger, []).append((p, params))
    # one request after another, each alone, would take 16 * (1-3 prefill steps + new)
    reqs, steps = run_arrivals(eng, arrivals, max_steps=16 * (3 + new))
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert max(r.num_preemptions for r in reqs) <= MAX_RETRACTIONS
    if new > prompt_len:
        assert eng.scheduler.num_preemptions > 0  # the case really retracted
    else:  # admission left room for the running requests' growth: nobody was retracted
        assert eng.scheduler.num_preemptions == 0
    assert eng.cache.is_fully_free()
    alone = crowd_engine(path, pages)
    for prompt, r in zip(prompts[::5], reqs[::5]):  # retraction recomputes exactly
        ref = alone.add_request(prompt, params)[0]
        drive(alone)
        assert r.output_token_ids == ref.output_token_ids


def test_the_oldest_request_is_never_the_victim(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = crowd_engine(path)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    first = eng.add_request(random_prompt(PROMPT, 1), params)[0]
    later = [eng.add_request(random_prompt(PROMPT, 2 + i), params)[0] for i in range(6)]
    drive(eng, until=lambda: first.is_finished)
    assert first.num_preemptions == 0
    drive(eng)
    assert all(r.finish_reason is FinishReason.LENGTH for r in later)


def test_admission_leaves_room_for_the_running_requests_growth(tiny_hybrid, monkeypatch):
    """Long outputs on a small pool: admitting by what a request writes now alone retracts
    over and over; keeping room for the running requests' expected growth retracts less."""
    from swaserve.engine import scheduler

    path, _ = tiny_hybrid
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    def retractions() -> int:
        eng = crowd_engine(path, 64)
        run_arrivals(eng, {0: [(random_prompt(40, 100 + i), params) for i in range(16)]},
                     2000)
        return eng.scheduler.num_preemptions

    with_estimate = retractions()
    monkeypatch.setattr(scheduler, "RATIO_INIT", 0.0)
    monkeypatch.setattr(scheduler, "RATIO_MIN", 0.0)
    without = retractions()
    assert with_estimate < without, (with_estimate, without)
