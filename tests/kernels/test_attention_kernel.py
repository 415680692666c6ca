"""The decode attention kernel (kernels/attention.c): exact softmax over the keys where the
cache holds them, each row independent of the others, at least as close to the float32
reference as torch's SDPA in bf16."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import attention as kernel
from swaserve.kernels import build
from tests.conftest import TINY_WINDOW as W
from tests.conftest import hf_logits, random_prompt, roomy_engine, run_logged

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


def counting(fn, ran_only: bool = False):
    """fn, and a list that gains an entry at each call of the returned wrapper (with
    `ran_only`, at each call that did not return None: the kernel ran)."""
    calls = []

    def counted(*a, **kw):
        out = fn(*a, **kw)
        if out is not None or not ran_only:
            calls.append(1)
        return out

    return counted, calls


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
    from swaserve.models import attention as backend

    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (3, W + 1, 3 * W + 2)]
    counted, calls = counting(kernel.decode_attention_bf16)

    errors = {}
    for path_name, fn in (("kernel", counted), ("sdpa", lambda *a, **kw: None)):
        monkeypatch.setattr(backend, "decode_attention_bf16", fn)
        runs = run_logged(roomy_engine(path, dtype="bfloat16"), prompts, 3 * W)
        worst = 0.0
        for p, (tokens, logs) in zip(prompts, runs):
            want = hf_logits(ref, p + tokens)
            for i, lg in enumerate(logs):
                worst = max(worst, (lg - want[len(p) - 1 + i]).abs().max().item())
        errors[path_name] = worst
    assert calls, "the decode steps did not reach the kernel"
    assert errors["kernel"] <= 1.25 * errors["sdpa"] + 1e-3, errors


prefill = pytest.mark.skipif(not kernel.prefill_available(),
                             reason="no AVX-512 BF16 here: prompt chunks take torch's SDPA")


def prompt_case(n, length, h, kvh, d, seed, window=None):
    """A chunk of n queries at positions length - n .. length - 1 over `length` keys,
    causal (and banded with `window`) as a bool mask."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, h, d, generator=g) * 2).to(torch.bfloat16)
    k = torch.randn(length, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(length, kvh, d, generator=g).to(torch.bfloat16)
    qpos, kpos = torch.arange(length - n, length)[:, None], torch.arange(length)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return q, k, v, mask


def prompt_attention(q, k, v, mask, scale, sinks, dtype):
    """SDPA in `dtype` (float64: the reference; bf16: torch's flash kernel), a sink as one
    more key of zeros whose mask entry is its logit."""
    n, h, d = q.shape
    rep = h // k.shape[1]
    kd, vd = (t.to(dtype).repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
    bias = torch.zeros(h, n, k.shape[0] + 1, dtype=dtype)
    bias[..., :-1].masked_fill_(~mask[None], float("-inf"))
    bias[..., -1] = float("-inf") if sinks is None else sinks.to(dtype)[:, None]
    zeros = torch.zeros(h, 1, d, dtype=dtype)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1), torch.cat([kd, zeros], 1), torch.cat([vd, zeros], 1),
        attn_mask=bias, scale=scale)
    return o.transpose(0, 1).reshape(n, h * d).double()


@prefill
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("n,length,h,kvh,d,window,causal", [
    (2, 2, 4, 1, 256, None, True), (37, 37, 4, 1, 256, None, True),
    (37, 50, 8, 2, 64, None, False), (29, 300, 6, 2, 32, 40, False),
    (100, 100, 3, 3, 64, 16, False), (130, 130, 16, 1, 64, None, True),
    (20, 20, 4, 2, 16, None, True)])
def test_prompt_attention_is_as_close_to_float64_as_torchs_bf16_flash(
        n, length, h, kvh, d, window, causal, with_sinks):
    """GQA groups of 1 to 16 heads, causal with no mask, with keys before the chunk, banded
    masks (the sliding layers' one-shot prompts), sinks (gpt-oss: from far below to far
    above the scores); p is rounded to bf16 for p . v as in torch's flash kernel, so the
    bound is that kernel's own error."""
    q, k, v, mask = prompt_case(n, length, h, kvh, d, seed=n + d, window=window)
    sinks = torch.linspace(-30, 12, h) if with_sinks else None
    out = kernel.prefill_attention_bf16(q, k, v, None if causal else mask, d ** -0.5, sinks)
    assert out.dtype == torch.bfloat16 and out.shape == (n, h * d)
    ref = prompt_attention(q, k, v, mask, d ** -0.5, sinks, torch.float64)
    flash_err = (prompt_attention(q, k, v, mask, d ** -0.5, sinks, torch.bfloat16)
                 - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 1.25 * flash_err + 1e-3, (err, flash_err)
    assert err <= 2 ** -6 * v.abs().max().item()


@prefill
def test_a_prompt_rows_result_is_its_own_whatever_the_chunk_and_the_masked_keys():
    """A query's output is the same bits alone, in a chunk of any length, and with more
    keys after its own that the mask leaves out (a prefix hit reads the cache, a cold run
    the chunk: the same keys in the same order give the same bits); a row whose mask
    leaves nothing is zeros and changes no other."""
    q, k, v, mask = prompt_case(60, 90, 4, 1, 64, seed=3, window=33)
    whole = kernel.prefill_attention_bf16(q, k, v, mask, 0.125)
    for lo, hi in [(0, 1), (7, 20), (59, 60)]:
        assert torch.equal(kernel.prefill_attention_bf16(q[lo:hi], k, v, mask[lo:hi], 0.125),
                           whole[lo:hi])
    last = 90 - 60 + 19  # query 19 sees keys up to 49: the keys after it, dropped, change nothing
    assert torch.equal(kernel.prefill_attention_bf16(
        q[19:20], k[:last + 1], v[:last + 1], mask[19:20, :last + 1], 0.125), whole[19:20])
    causal = prompt_case(40, 40, 4, 1, 64, seed=4)
    full = kernel.prefill_attention_bf16(*causal[:3], None, 0.125)
    assert torch.equal(kernel.prefill_attention_bf16(*causal[:3], causal[3], 0.125), full)
    mask[5] = False
    holes = kernel.prefill_attention_bf16(q, k, v, mask, 0.125)
    assert (holes[5] == 0).all()
    assert torch.equal(holes[torch.arange(60) != 5], whole[torch.arange(60) != 5])


@prefill
def test_prompt_kernel_turns_down_what_it_does_not_take():
    q, k, v, mask = prompt_case(8, 8, 4, 1, 64, seed=1)
    assert kernel.prefill_attention_bf16(q.float(), k.float(), v.float(), None, 1.0) is None
    assert kernel.prefill_attention_bf16(q, k[:4], v[:4], None, 1.0) is None  # fewer keys than causal needs
    assert kernel.prefill_attention_bf16(q[..., :24], k[..., :24], v[..., :24], None, 1.0) is None
    assert kernel.prefill_attention_bf16(q[:, :3], k.repeat(1, 2, 1), v.repeat(1, 2, 1), None,
                                         1.0) is None


@prefill
def test_bf16_prompts_through_the_kernel_are_as_close_to_the_reference_as_sdpa(
        tiny_hybrid, monkeypatch):
    """A tiny hybrid model's bf16 prompts in one chunk and in chunks (keys from the cache,
    banded sliding masks, prompts past three windows): with the prompt kernel the logits
    are no further from transformers' float32 logits than with torch's SDPA, and the
    greedy tokens are the same."""
    from swaserve.models import attention as backend

    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (5, W + 3, 3 * W + 2)]
    counted, calls = counting(kernel.prefill_attention_bf16, ran_only=True)
    # where AMX is, the engine leaves prompts to SDPA (faster there): the kernel is forced
    monkeypatch.setattr(backend, "prefill_preferred", kernel.prefill_available)

    errors, tokens = {}, {}
    for path_name, fn in (("kernel", counted), ("sdpa", lambda *a, **kw: None)):
        monkeypatch.setattr(backend, "prefill_attention_bf16", fn)
        for chunk in (None, W // 2 + 1):
            kw = {} if chunk is None else {"chunk_size": chunk}
            runs = run_logged(roomy_engine(path, dtype="bfloat16", **kw), prompts, 4)
            worst = 0.0
            for p, (toks, logs) in zip(prompts, runs):
                want = hf_logits(ref, p + toks)
                worst = max(worst, (logs[0] - want[len(p) - 1]).abs().max().item())
            errors[path_name, chunk] = worst
            tokens[path_name, chunk] = [toks for toks, _ in runs]
    assert calls, "the prompts did not reach the kernel"
    for chunk in (None, W // 2 + 1):
        assert errors["kernel", chunk] <= 1.25 * errors["sdpa", chunk] + 1e-3, errors
        assert tokens["kernel", chunk] == tokens["sdpa", chunk]
