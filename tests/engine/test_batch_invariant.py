"""Batch-invariant mode: a request's logits do not depend on what else is in its steps.
The real-model bf16 check is tests/e2e/test_real_model.py; these pin the parts."""

from __future__ import annotations

import pytest
import torch

from swaserve import LLM, SamplingParams
from swaserve.models.layers import linear
from tests.conftest import TEST_DEVICE, random_prompt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_blocks_give_every_row_the_bits_it_gets_alone(dtype):
    """The kernel property the mode rests on: in blocks of 32 rows, a row's product is the
    same as on its own and as in a batch of any other size (1 to 40 rows here: matrix-vector
    for one row, and float32 tails of M % 4 rows under 12 on AMD's MKL, round some rows
    differently on the plain path)."""
    g = torch.Generator().manual_seed(0)
    for n, k in [(4096, 640), (640, 2048), (1536, 640), (128, 32)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(2000, k, generator=g).to(dtype)
        blocked = linear(x, w, row_block=32)
        rows = range(2000) if n == 128 else (0, 31, 32, 63, 99)
        for i in rows:
            assert torch.equal(blocked[i], linear(x[i:i + 1], w, row_block=32)[0]), (n, k, i)
        for m in range(1, 41):
            assert torch.equal(linear(x[:m], w, row_block=32), blocked[:m]), (n, k, m)
    if dtype == torch.bfloat16:
        assert any(not torch.equal(blocked[i], linear(x[i:i + 1], w)[0]) for i in range(2000))


def test_prompts_are_chunked_at_fixed_positions_and_decodes_never_wait(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="bfloat16", device=TEST_DEVICE, batch_invariant=True, chunk_size=16,
              max_running_requests=12)
    eng = llm.engine
    assert eng.cache.prefix is None  # a hit would start a prompt's chunks at the hit
    seen = []
    schedule = eng.scheduler.schedule

    def spy(*a, **kw):
        batch = schedule(*a, **kw)
        seen.append([(s.request.request_id, s.start, s.num_tokens, s.request.num_prompt_tokens)
                     for s in batch.seqs])
        return batch

    eng.scheduler.schedule = spy
    prompts = [random_prompt(5 + 13 * i, i) for i in range(10)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for step in seen:
        prefill = [(start, n, plen) for _, start, n, plen in step if start < plen]
        assert sum(n for _, n, _ in prefill if n > 1) <= 16
        for start, n, plen in prefill:
            assert start % 16 == 0 and n == min(16, plen - start)
    decode_steps: dict[str, list[int]] = {}
    for i, step in enumerate(seen):
        for rid, start, _, plen in step:
            if start >= plen:
                decode_steps.setdefault(rid, []).append(i)
    assert len(decode_steps) == len(prompts)
    for steps in decode_steps.values():  # once decoding, a request is in every step
        assert steps == list(range(steps[0], steps[0] + len(steps)))


@pytest.mark.parametrize("dtype,kv", [("bfloat16", "auto"), ("float32", "auto"),
                                      ("bfloat16", "int8"), ("float32", "fp8_e4m3")])
def test_alone_and_in_a_crowd_bitwise(tiny_hybrid, dtype, kv):
    """float32 too: its attention takes SDPA's math kernel in this mode (torch's float32
    flash kernel gives different bits on different threads on some CPUs). A quantized KV
    cache quantizes each token's heads on their own, so it keeps the contract."""
    path, _ = tiny_hybrid
    llm = LLM(path, dtype=dtype, device=TEST_DEVICE, batch_invariant=True, chunk_size=16,
              max_running_requests=40, kv_cache_dtype=kv)
    eng = llm.engine
    probe = random_prompt(37, 99)
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    eng.logits_log = []
    alone = llm.generate([probe], p)[0]
    solo = {pos: lg for rid, pos, lg in eng.logits_log}
    eng.logits_log = []
    crowd = llm.generate([probe] + [random_prompt(3 + i, i) for i in range(35)],
                         [p] + [SamplingParams(temperature=1.0, max_tokens=4 + i % 5)
                                for i in range(35)])
    assert crowd[0].token_ids == alone.token_ids
    rows = [(pos, lg) for rid, pos, lg in eng.logits_log if rid == crowd[0].request_id]
    assert len(rows) == 12 and all(torch.equal(lg, solo[pos]) for pos, lg in rows)
