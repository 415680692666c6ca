"""The decode attention kernel (kernels/attention.c): exact softmax over the keys where the
cache holds them, each row independent of the others, at least as close to the float32
reference as torch's SDPA in bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_WINDOW as W
from conftest import hf_logits, random_prompt

from swaserve.kernels import attention as kernel
from swaserve.kernels import build

pytestmark = pytest.mark.skipif(build.load("attention") is None,
                                reason="no C compiler for the kernel")


def case(b, h, kvh, d, length, seed, slots_total=500):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots_total, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(slots_total, kvh, d, generator=g).to(torch.bfloat16)
    q = (torch.randn(b, h, d, generator=g) * 2).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:length] for _ in range(b)])
    mask = torch.rand(b, length, generator=g) < 0.7
    mask[:, 0] = True
    return q, k, v, slots, mask


def reference(q, k, v, slots, mask, scale, sinks=None):
    """float64 attention of the same bf16 values, one extra zero-valued key for a sink."""
    b, h, d = q.shape
    kg = k[slots].double().transpose(1, 2)  # [B, KVH, L, D]
    vg = v[slots].double().transpose(1, 2)
    rep = h // k.shape[1]
    kg, vg = kg.repeat_interleave(rep, 1), vg.repeat_interleave(rep, 1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), kg) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None].expand(b, h, 1)], dim=-1)
        vg = torch.cat([vg, torch.zeros(b, h, 1, d, dtype=vg.dtype)], dim=2)
    p = s.softmax(-1)
    return torch.einsum("bhl,bhld->bhd", p, vg).reshape(b, h * d)


@pytest.mark.parametrize("b,h,kvh,d,length", [(1, 4, 1, 256, 37), (5, 8, 2, 64, 100),
                                              (3, 2, 2, 16, 9), (32, 4, 1, 256, 200)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_is_the_exact_softmax_rounded_once(b, h, kvh, d, length, with_sinks):
    q, k, v, slots, mask = case(b, h, kvh, d, length, seed=b * 100 + d)
    sinks = torch.linspace(-2, 3, h) if with_sinks else None
    out = kernel.decode_attention_bf16(q, k, v, slots, mask, d ** -0.5, sinks)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h * d)
    ref = reference(q, k, v, slots, mask, d ** -0.5, sinks)
    # float32 sums in another order than float64: within one bf16 step of the exact value,
    # and almost always its nearest bf16
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    assert (out == ref.to(torch.bfloat16)).float().mean() > 0.98


def test_a_rows_result_is_its_own_alone_and_without_the_masked_keys():
    q, k, v, slots, mask = case(6, 4, 1, 64, 50, seed=7)
    whole = kernel.decode_attention_bf16(q, k, v, slots, mask, 0.125)
    for r in range(6):
        alone = kernel.decode_attention_bf16(q[r:r + 1], k, v, slots[r:r + 1], mask[r:r + 1], 0.125)
        assert torch.equal(alone, whole[r:r + 1])
        keep = slots[r][mask[r]][None]
        assert torch.equal(kernel.decode_attention_bf16(q[r:r + 1], k, v, keep, None, 0.125),
                           whole[r:r + 1])


def test_kernel_turns_down_what_it_does_not_take():
    q, k, v, slots, mask = case(2, 4, 1, 64, 10, seed=1)
    assert kernel.decode_attention_bf16(q.float(), k.float(), v.float(), slots, mask, 1.0) is None
    assert kernel.decode_attention_bf16(q, k, v, slots.int(), mask, 1.0) is None
    q3 = torch.zeros(2, 3, 64, dtype=torch.bfloat16)  # 3 query heads cannot share 2 kv heads
    assert kernel.decode_attention_bf16(q3, k.repeat(1, 2, 1), v.repeat(1, 2, 1), slots, mask,
                                        1.0) is None


def test_bf16_decode_through_the_kernel_is_as_close_to_the_reference_as_sdpa(
        tiny_hybrid, monkeypatch):
    """A tiny hybrid model decoding past three windows in bf16 (wrapped rings, several
    pages): with the kernel its logits are no further from transformers' float32 logits
    than with torch's SDPA on the gathered keys."""
    from test_attention_contracts import make_engine, run_logged

    from swaserve.models import attention as backend

    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (3, W + 1, 3 * W + 2)]
    calls = []
    real = kernel.decode_attention_bf16

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    errors = {}
    for path_name, fn in (("kernel", counted), ("sdpa", lambda *a, **kw: None)):
        monkeypatch.setattr(backend, "decode_attention_bf16", fn)
        runs = run_logged(make_engine(path, dtype="bfloat16"), prompts, 3 * W)
        worst = 0.0
        for p, (tokens, logs) in zip(prompts, runs):
            want = hf_logits(ref, p + tokens)
            for i, lg in enumerate(logs):
                worst = max(worst, (lg - want[len(p) - 1 + i]).abs().max().item())
        errors[path_name] = worst
    assert calls, "the decode steps did not reach the kernel"
    assert errors["kernel"] <= 1.25 * errors["sdpa"] + 1e-3, errors
