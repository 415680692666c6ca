"""Speculative decoding's cache: after any pattern of accepted and rejected drafts it
holds, position by position, what a non-speculative run holds."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve.sampling.params import SamplingParams
from tests.conftest import TINY_WINDOW as W
from tests.conftest import random_prompt, tiny_engine
from tests.engine.conftest import spec_engine

pytest.importorskip("llguidance")


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
    computed, the ring's positions inside the window, and its window-page positions (as
    the pools give them back: a quantized cache's values and scales)."""
    cache, row, n = eng.cache, req.row, req.num_computed_tokens
    out = {}

    def kv(pool, d, slot):
        return torch.cat(pool.read(d, lambda b: b[slot], torch.float32))

    if cache.full is not None:
        for d in range(len(cache.full.k)):
            slots = cache.rows.req_to_token[row, :n]
            for p in range(n):
                out[("full", d, p)] = kv(cache.full, d, slots[p])
    if cache.window is not None:
        ring = cache.window.ring
        held = cache.window.positions[row * ring:(row + 1) * ring]
        assert not (held >= n).any(), "a ring slot claims a position not computed"
        for p in range(max(0, n - W), n):
            slot = row * ring + p % ring
            assert int(cache.window.positions[slot]) == p
            for d in range(len(cache.window.k)):
                out[("ring", d, p)] = kv(cache.window, d, slot)
    if cache.window_pages is not None:
        pages, ps = cache.row_window_pages[row], cache.page_size
        for p in range(n):
            w = pages[p // ps] if p // ps < len(pages) else None
            if w is not None:
                for d in range(len(cache.window_pages.k)):
                    out[("page", d, p)] = kv(cache.window_pages, d, w * ps + p % ps)
    return out


@pytest.mark.parametrize("seed,kv", [(0, "auto"), (1, "auto"), (2, "auto"), (0, "int8"),
                                     (1, "fp8_e4m3")])
def test_cache_after_random_accepts_and_rejects_is_the_non_speculative_cache(tiny_hybrid, seed,
                                                                              kv):
    path = tiny_hybrid[0]
    prompts = [random_prompt(3 * W + 3 + 5 * i, 10 + i) for i in range(3)]
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=3 * W + 4, ignore_eos=True)
    # the reference: no drafts; the KV of each position as each step leaves it
    ref_eng = tiny_engine(path, kv_cache_dtype=kv)
    reqs = [ref_eng.add_request(p, params)[0] for p in prompts]
    ref_kv: dict[str, dict] = {r.request_id: {} for r in reqs}
    while ref_eng.has_unfinished():
        ref_eng.step()
        for r in reqs:
            if r.row is not None:
                ref_kv[r.request_id].update(kv_of(ref_eng, r))
    reference = {r.request_id: r.output_token_ids for r in reqs}

    eng = spec_engine(path, speculative="ngram", kv_cache_dtype=kv)
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
