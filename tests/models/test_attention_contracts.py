"""The attention contracts (docs/architecture.md) on tiny random Gemma 3 models against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch

from swaserve import LLM, SamplingParams
from swaserve.engine.engine import Engine
from swaserve.engine.request import Request
from swaserve.engine.scheduler import Batch, ScheduledSeq
from swaserve.memory.window_pool import EMPTY
from tests.conftest import (
    TEST_DEVICE,
    drive,
    hf_greedy,
    hf_logits,
    random_prompt,
    roomy_engine,
    run_logged,
)
from tests.conftest import TINY_WINDOW as W

# float32 round-off: logits of these tiny models are O(1); observed differences ~1e-6
TOL = 1e-4


@pytest.mark.parametrize("chunk", [1, 7, W - 1, W, W + 1, 2 * W + 3, 64])
def test_chunked_prefill_matches_one_shot_reference(tiny_hybrid, chunk):
    path, ref = tiny_hybrid
    prompt = random_prompt(4 * W + 5, seed=chunk)
    eng = roomy_engine(path, chunk_size=chunk)
    [(tokens, logs)] = run_logged(eng, [prompt], 3 * W)
    full = prompt + tokens
    want = hf_logits(ref, full)
    for i, lg in enumerate(logs):
        pos = len(prompt) - 1 + i
        assert (lg - want[pos]).abs().max().item() < TOL, f"position {pos}"
    assert tokens == hf_greedy(ref, prompt, len(tokens))


def test_ragged_mixed_batches_match_alone(tiny_hybrid):
    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (1, 3, W - 1, W, W + 1, 3 * W + 2, 5 * W)]
    alone = [run_logged(roomy_engine(path, chunk_size=512), [p], 2 * W)[0] for p in prompts]
    # a budget of 13 tokens splits prompts raggedly and mixes prefill chunks with decodes
    together = run_logged(roomy_engine(path, chunk_size=13), prompts, 2 * W)
    for (ta, la), (tb, lb), p in zip(alone, together, prompts):
        assert ta == tb
        assert ta == hf_greedy(ref, p, len(ta))
        for x, y in zip(la, lb):
            assert (x - y).abs().max().item() < TOL


def test_batched_decode_of_different_lengths_equals_alone(tiny_hybrid):
    path, _ = tiny_hybrid
    prompts = [random_prompt(2 + 5 * i, seed=100 + i) for i in range(8)]
    alone = [run_logged(roomy_engine(path), [p], 3 * W)[0] for p in prompts]
    together = run_logged(roomy_engine(path), prompts, 3 * W)
    for (ta, la), (tb, lb) in zip(alone, together):
        assert ta == tb
        assert max((x - y).abs().max().item() for x, y in zip(la, lb)) < TOL


@pytest.mark.parametrize("fixture", ["tiny_all_sliding", "tiny_no_sliding"])
def test_all_sliding_and_no_sliding_layouts(request, fixture):
    path, ref = request.getfixturevalue(fixture)
    eng = roomy_engine(path, chunk_size=W + 3)
    if fixture == "tiny_all_sliding":
        assert eng.cache.full is None and eng.cache.window is not None
    else:
        assert eng.cache.window is None and eng.cache.full is not None
    prompts = [random_prompt(n, seed=n) for n in (5, 3 * W + 1)]
    results = run_logged(eng, prompts, 2 * W)
    for p, (tokens, logs) in zip(prompts, results):
        want = hf_logits(ref, p + tokens)
        for i, lg in enumerate(logs):
            assert (lg - want[len(p) - 1 + i]).abs().max().item() < TOL
        assert tokens == hf_greedy(ref, p, len(tokens))


def _prepare_one(eng: Engine, prompt, chunks):
    """Feed `prompt` through the scheduler in the given chunk sizes; yield each prepared batch."""
    req = Request("r", prompt, SamplingParams(max_tokens=4), eng.max_model_len)
    eng.scheduler.add(req)
    eng.scheduler.waiting.clear()
    req.row = eng.cache.alloc_row()
    req.status = req.status.RUNNING
    start = 0
    for n in chunks:
        eng.cache.ensure_slots(req.row, start + n)
        batch = Batch([ScheduledSeq(req, start, n, start + n == len(prompt))])
        prepared = eng.runner.prepare(batch)
        yield req, start, n, prepared
        eng.runner.forward(prepared)
        req.num_computed_tokens = start = start + n


def test_masks_match_positions_and_window(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = roomy_engine(path, chunk_size=W + 1)
    ring = eng.cache.window.ring
    prompt = random_prompt(5 * W, seed=5)
    for _req, start, n, prepared in _prepare_one(eng, prompt, [3, W - 3, 1, W + 1, W, 2, W + 1]):
        [g] = prepared.ctx.groups
        qpos = torch.arange(start, start + n)
        for kind, view in (("full", g.full), ("sliding", g.sliding)):
            if view.fresh:
                kpos = qpos
            elif kind == "full":
                kpos = torch.arange(view.key_slots.shape[-1])
            else:
                kpos = eng.cache.window.positions[view.key_slots[0]]
            mask = (view.mask[0, 0] if view.mask is not None
                    else kpos[None, :] <= qpos[:, None])
            assert mask.shape[-1] == kpos.numel()  # width == keys returned
            lo = qpos[:, None] - W if kind == "sliding" else torch.full((n, 1), -1)
            expect = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > lo) & (kpos[None, :] != EMPTY)
            assert torch.equal(mask, expect)
            if kind == "sliding" and start + n <= W:  # the window cannot bind: plain causal
                assert view.fresh or view.key_slots.shape[-1] == start + n
                assert view.mask is None or view.key_slots.shape[-1] <= W
            if kind == "sliding" and start + n > W and not view.fresh:
                # a prefill chunk reads the whole ring; a decode row at most the ring
                assert view.key_slots.shape[-1] == (ring if n > 1 else min(start + 1, ring))


def test_ring_holds_at_most_ring_tokens_after_3w(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = roomy_engine(path, chunk_size=5)
    ring = eng.cache.window.ring
    req = eng.add_request(random_prompt(3 * W + 7, seed=9),
                          SamplingParams(temperature=0, max_tokens=2 * W, ignore_eos=True))[0]
    while req.num_output_tokens < 2 * W - 1:
        eng.step()
        if req.row is not None:
            held = eng.cache.window.positions[req.row * ring:(req.row + 1) * ring]
            held = sorted(p for p in held.tolist() if p != EMPTY)
            assert len(held) <= ring
            last = req.num_computed_tokens
            assert held == list(range(max(0, last - ring), last))
    assert ring < 3 * W + 7
    drive(eng)
    assert eng.cache.is_fully_free()


def test_alloc_hook_fires_for_new_rows_only(tiny_hybrid):
    path, _ = tiny_hybrid
    eng = roomy_engine(path, chunk_size=7)
    calls: list[list[int]] = []
    eng.cache.rows.register_on_alloc_rows(lambda rows: calls.append(list(rows)))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request(random_prompt(40, seed=1), params)
    eng.add_request(random_prompt(25, seed=2), params)
    steps = drive(eng)
    assert steps > 8  # many chunked steps ...
    assert len(calls) == 2 and all(len(c) == 1 for c in calls)  # ... but one call per request


def test_retraction_under_tiny_full_pool_completes_with_same_output(tiny_hybrid):
    path, _ = tiny_hybrid
    prompts = [random_prompt(10 + 3 * i, seed=200 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="64MiB",
                max_running_requests=8)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    # each request needs <= 7 pages of 8 tokens; the pool holds 12 pages for 8 rows
    tiny = roomy_engine(path, max_running_requests=8, page_size=8, chunk_size=16, prefix_cache=False,
                       kv_memory=_budget_for_pages(path, 12, 8))
    assert tiny.cache.num_total_pages == 12
    reqs = [tiny.add_request(p, params)[0] for p in prompts]
    drive(tiny)
    assert tiny.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in reqs] == want
    assert tiny.cache.is_fully_free()
    tiny.check_integrity()


def _budget_for_pages(path, pages, page_size, rows=8, chunk=16):
    from swaserve.checkpoint.source import resolve_model
    from swaserve.memory.planner import fixed_bytes_per_row, full_bytes_per_token

    layout = resolve_model(path).model_config().cache_layout()
    ring = layout.ring_size(chunk, page_size)
    return rows * fixed_bytes_per_row(layout, ring, 4, 512) + pages * page_size * full_bytes_per_token(layout, 4)


@pytest.mark.parametrize("block", [3, 5])
def test_a_long_fresh_chunk_attends_its_band_block_by_block(tiny_hybrid, monkeypatch, block):
    """A one-shot prompt chunk longer than the window runs its sliding layers' attention in
    blocks of BAND_QUERIES queries, each over only the keys its queries' windows reach
    (models/attention.py `_banded`): the logits are still transformers', and the blocks
    did run."""
    from swaserve.models import attention as backend

    monkeypatch.setattr(backend, "BAND_QUERIES", block)
    shapes, real = [], backend.attend

    def spy(q, k, *args):
        if q.shape[2] > 1:  # prompt rows
            shapes.append((q.shape[2], k.shape[2]))
        return real(q, k, *args)

    monkeypatch.setattr(backend, "attend", spy)
    path, ref = tiny_hybrid
    prompt = random_prompt(4 * W + 5, seed=block)
    [(tokens, logs)] = run_logged(roomy_engine(path, chunk_size=64), [prompt], W)
    assert (block, block + W - 1) in shapes  # a block of queries over its band's keys
    want = hf_logits(ref, prompt + tokens)
    for i, lg in enumerate(logs):
        assert (lg - want[len(prompt) - 1 + i]).abs().max().item() < TOL
    assert tokens == hf_greedy(ref, prompt, len(tokens))
