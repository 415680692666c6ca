"""The attention kernels over int8 caches (kernels/attention_q8.c, attention.c's prompt
kernel): the exact softmax over the dequantized keys (a scale per block of 32 values, or
one a head: d = 40) up to the decode kernel's documented int16 roundings, closer to the
exact values than SDPA on the bf16-dequantized keys, each row independent of the others,
and in an engine with `kv_cache_dtype` int8 as close to the reference as SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swaserve.kernels import attention as kernel
from swaserve.kernels import build
from swaserve.memory.kv_quant import dequantize, kv_format, quantize
from tests.conftest import TINY_WINDOW as W
from tests.conftest import hf_logits, random_prompt, roomy_engine, run_logged
from tests.kernels.test_attention_kernel import case, counting, reference

pytestmark = pytest.mark.skipif(build.load("attention_q8") is None,
                                reason="no C compiler for the kernel")

INT8 = kv_format("int8", torch.bfloat16)


def int8_case(b, h, kvh, d, length, seed):
    q, k, v, slots, mask = case(b, h, kvh, d, length, seed)
    k[:50] *= 8  # heads of other magnitudes: scales that differ by slot
    (kq, ks), (vq, vs) = quantize(k, INT8), quantize(v, INT8)
    return q, kq, ks, vq, vs, slots, mask


def reference_int16(q, kq, ks, vq, vs, slots, mask, scale, sinks=None):
    """float64 attention over the dequantized keys with the int16 path's two roundings
    (kernels/attention_q8.c): each query head to int16 in units of its largest |value| /
    32767 (float32, as the kernel computes them), and each weight p_j * scale_jb (p_j
    = e^(s_j - max)) to int16 in units of the head's largest weight / 32767. Returns the
    output [B, H * D] and what one unit of a weight moves it by at most (127 units of a
    value over the softmax's denominator)."""
    b, h, d = q.shape
    kvh, nb = kq.shape[1], ks.shape[2]
    rep = h // kvh
    qf = q.float()
    qmax = qf.abs().amax(-1, keepdim=True)
    q16 = (qf * (32767.0 / qmax)).round().double() * (qmax / 32767.0).double()
    kg = dequantize(kq, ks, torch.float64)[slots].transpose(1, 2).repeat_interleave(rep, 1)  # [B, H, L, D]
    s = torch.einsum("bhd,bhld->bhl", q16, kg) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    mx = s.amax(-1, keepdim=True)
    if sinks is not None:
        mx = torch.maximum(mx, sinks.double()[None, :, None])
    p = (s - mx).exp()  # [B, H, L]
    total = p.sum(-1) + (0 if sinks is None else (sinks.double()[None] - mx[..., 0]).exp())
    vsg = vs[slots].double().transpose(1, 2).repeat_interleave(rep, 1)  # [B, H, L, nb]
    w = p[..., None] * vsg
    unit = w.flatten(2).amax(-1)[..., None, None] / 32767
    w16 = (w / unit).round() * unit
    vg = vq[slots].double().transpose(1, 2).repeat_interleave(rep, 1)  # [B, H, L, D]
    out = (vg.unflatten(-1, (nb, -1)) * w16[..., None]).sum(2).flatten(-2)
    step = (127 * unit[..., 0] / total[..., None]).expand(b, h, d)
    return (out / total[..., None]).reshape(b, h * d), step.reshape(b, h * d)


SHAPES = [(1, 4, 1, 256, 37), (5, 8, 2, 64, 100), (3, 2, 2, 16, 9), (32, 4, 1, 256, 200),
          (2, 3, 1, 40, 30), (2, 4, 1, 128, 450)]


@pytest.mark.parametrize("b,h,kvh,d,length", SHAPES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_int8_decode_attention_is_the_exact_softmax_of_the_dequantized_keys(
        b, h, kvh, d, length, with_sinks):
    """Within one bf16 step of the float64 softmax of what the kernel computes: with the
    int16 products, that of reference_int16 (its roundings emulated), else of the float64
    values the cache stands for. Beside the bf16 rounding, float32 sums in another order
    stay within 1e-5 of the exact value; with int16 weights, a float32 p a few ulps from
    the float64 one can put a weight on the other side of a rounding midpoint: a unit's
    step each, allowed for 4 weights."""
    q, kq, ks, vq, vs, slots, mask = int8_case(b, h, kvh, d, length, seed=b * 100 + d)
    sinks = torch.linspace(-2, 3, h) if with_sinks else None
    out = kernel.decode_attention_q8(q, kq, vq, ks, vs, slots, mask, d ** -0.5, sinks)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h * d)
    if kernel.q8_int16(d, ks.shape[2]):
        ref, step = reference_int16(q, kq, ks, vq, vs, slots, mask, d ** -0.5, sinks)
    else:  # the float64 values the cache stands for (no bf16 rounding of them)
        k64, v64 = dequantize(kq, ks, torch.float64), dequantize(vq, vs, torch.float64)
        ref, step = reference(q, k64, v64, slots, mask, d ** -0.5, sinks), 0.0
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5 + 4 * step).all()
    assert (out == ref.to(torch.bfloat16)).float().mean() > 0.97


@pytest.mark.parametrize("b,h,kvh,d,length", [(1, 4, 1, 256, 37), (32, 4, 1, 256, 200),
                                              (5, 8, 2, 64, 100), (2, 4, 1, 256, 3000)])
def test_int8_decode_attention_is_closer_to_the_exact_values_than_sdpa(b, h, kvh, d, length):
    """The int16 roundings cost less than the path the engine takes without the kernel:
    SDPA on the keys dequantized to bf16. Against the float64 attention of the values the
    cache stands for, the kernel's largest and mean errors are below SDPA's."""
    q, k, v, slots, mask = case(b, h, kvh, d, length, seed=3, slots_total=max(500, 2 * length))
    k[:50] *= 8
    (kq, ks), (vq, vs) = quantize(k, INT8), quantize(v, INT8)
    k64, v64 = dequantize(kq, ks, torch.float64), dequantize(vq, vs, torch.float64)
    ref = reference(q, k64, v64, slots, mask, d ** -0.5)
    out = kernel.decode_attention_q8(q, kq, vq, ks, vs, slots, mask, d ** -0.5)
    kb, vb = k64[slots].bfloat16().transpose(1, 2), v64[slots].bfloat16().transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q[:, :, None], kb, vb, attn_mask=mask[:, None, None],
                                          scale=d ** -0.5, enable_gqa=True).reshape(b, -1)
    ours, theirs = (out.double() - ref).abs(), (sdpa.double() - ref).abs()
    assert ours.max() < theirs.max() and ours.mean() < theirs.mean()


def test_an_int8_rows_result_is_its_own_alone_and_without_the_masked_keys():
    q, kq, ks, vq, vs, slots, mask = int8_case(6, 4, 1, 64, 50, seed=7)
    whole = kernel.decode_attention_q8(q, kq, vq, ks, vs, slots, mask, 0.125)
    for r in range(6):
        alone = kernel.decode_attention_q8(q[r:r + 1], kq, vq, ks, vs, slots[r:r + 1],
                                           mask[r:r + 1], 0.125)
        assert torch.equal(alone, whole[r:r + 1])
        keep = slots[r][mask[r]][None]
        assert torch.equal(kernel.decode_attention_q8(q[r:r + 1], kq, vq, ks, vs, keep, None,
                                                      0.125), whole[r:r + 1])


def test_int8_kernel_turns_down_what_it_does_not_take():
    q, kq, ks, vq, vs, slots, mask = int8_case(2, 4, 1, 64, 10, seed=1)
    assert kernel.decode_attention_q8(q.float(), kq, vq, ks, vs, slots, mask, 1.0) is None
    assert kernel.decode_attention_q8(q, kq.float(), vq, ks, vs, slots, mask, 1.0) is None
    assert kernel.decode_attention_q8(q, kq, vq, ks.double(), vs, slots, mask, 1.0) is None
    assert kernel.decode_attention_q8(q, kq, vq, ks[..., 0], vs, slots, mask, 1.0) is None
    assert kernel.decode_attention_q8(q, kq, vq, ks[..., :1].repeat(1, 1, 3).contiguous(),
                                      vs, slots, mask, 1.0) is None  # 3 blocks do not divide 64


def test_int8_decode_through_the_kernel_is_as_close_to_the_reference_as_sdpa(
        tiny_hybrid, monkeypatch):
    """A tiny hybrid model decoding past three windows in bf16 with an int8 cache: with the
    kernel its logits are no further from transformers' float32 logits than with SDPA on
    the dequantized keys."""
    from swaserve.models import attention as backend

    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (3, W + 1, 3 * W + 2)]
    counted, calls = counting(kernel.decode_attention_q8, ran_only=True)
    errors = {}
    for name, fn in (("kernel", counted), ("sdpa", lambda *a, **kw: None)):
        monkeypatch.setattr(backend, "decode_attention_q8", fn)
        runs = run_logged(roomy_engine(path, dtype="bfloat16", kv_cache_dtype="int8"),
                          prompts, 3 * W)
        worst = 0.0
        for p, (out, logs) in zip(prompts, runs):
            want = hf_logits(ref, p + out)
            for i, lg in enumerate(logs):
                worst = max(worst, (lg - want[len(p) - 1 + i]).abs().max().item())
        errors[name] = worst
    assert calls, "the decode steps did not reach the kernel"
    assert errors["kernel"] <= 1.25 * errors["sdpa"] + 1e-3, errors


@pytest.mark.skipif(not kernel.prefill_available(),
                    reason="no AVX-512 BF16 here: prompt chunks take torch's SDPA")
@pytest.mark.parametrize("n,length,h,kvh,d,causal", [(37, 50, 8, 2, 64, False),
                                                     (20, 20, 4, 1, 256, True),
                                                     (5, 300, 6, 2, 32, False)])
def test_int8_prompt_attention_is_the_bf16_kernel_on_torchs_dequantized_keys(
        n, length, h, kvh, d, causal):
    """The keys where the int8 cache holds them, dequantized while packed, give the bits of
    the bf16 kernel on the keys memory/kv_quant.py dequantizes."""
    g = torch.Generator().manual_seed(n + d)
    pool = 400
    k = torch.randn(pool, kvh, d, generator=g) * torch.rand(pool, kvh, 1, generator=g) * 4
    v = torch.randn(pool, kvh, d, generator=g)
    (kq, ks), (vq, vs) = quantize(k, INT8), quantize(v, INT8)
    slots = torch.randperm(pool, generator=g)[:length]
    q = (torch.randn(n, h, d, generator=g) * 2).to(torch.bfloat16)
    mask = None if causal else torch.rand(n, length, generator=g) < 0.6
    sinks = torch.linspace(-3, 2, h)
    got = kernel.prefill_attention_q8(q, kq, vq, ks, vs, slots, mask, d ** -0.5, sinks)
    want = kernel.prefill_attention_bf16(q, dequantize(kq[slots], ks[slots], torch.bfloat16),
                                         dequantize(vq[slots], vs[slots], torch.bfloat16), mask,
                                         d ** -0.5, sinks)
    assert got is not None and torch.equal(got, want)
