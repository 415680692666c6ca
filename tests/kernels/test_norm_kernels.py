"""The bf16 row kernels around the matmuls (kernels/norm.c, kernels/gelu.c): torch's float32
math with its bf16 roundings; the fused ones give the unfused path's bits exactly."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swaserve.kernels import build
from swaserve.models.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq

kernels = pytest.mark.skipif(build.load("norm") is None, reason="no C compiler for the kernel")


def test_rms_norm_kernel_matches_torch_on_rows_and_head_views():
    from swaserve.kernels.norm import rms_norm_bf16

    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(9, 1536, generator=g) * 3).to(torch.bfloat16)
    for x, w in [(qkv[:, :640], torch.rand(640, generator=g) + 0.5),
                 (qkv[:, :1024].view(9, 4, 256), torch.rand(256, generator=g) + 0.5)]:
        got = rms_norm_bf16(x, w, 1e-6)
        if got is None:
            pytest.skip("no C compiler for the kernel")
        ref = F.rms_norm(x.float(), w.shape, w, 1e-6).to(torch.bfloat16)
        assert got.shape == x.shape and got.is_contiguous()
        # float32 sums in another order: at most one bf16 step apart, almost always equal
        assert (got != ref).float().mean() < 1e-3
        assert torch.allclose(got.float(), ref.float(), rtol=2**-7, atol=0)
    assert rms_norm_bf16(qkv.float(), torch.ones(1536), 1e-6) is None  # not bf16: torch


def test_gelu_tanh_mul_kernel_matches_torch():
    from swaserve.kernels.gelu import gelu_tanh_mul_bf16

    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(37, 2 * 1000, generator=g) * 4).to(torch.bfloat16)
    gu[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-20, -1e-20])
    got = gelu_tanh_mul_bf16(gu)
    if got is None:
        pytest.skip("no C compiler for the kernel")
    gate, up = gu.chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    # float32 exp in place of torch's tanh: its bf16 values but at a rounding boundary and
    # where 1 + tanh(u) cancels (gate near -5: values below 1e-5) and rounds the other way
    assert (got != ref).float().mean() < 0.01
    assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
    strided = torch.cat([gu, gu], 1)[:, :2000]  # rows 4000 apart
    assert torch.equal(gelu_tanh_mul_bf16(strided), got)
    assert gelu_tanh_mul_bf16(gu.float()) is None


def torch_rms_norm(x, w, eps=1e-6):
    """RMSNorm in torch alone (float32 math, one bf16 rounding): a reference that shares no
    code with the C kernels, which `rms_norm` calls for bf16 rows."""
    return F.rms_norm(x.float(), w.shape, w, eps).to(torch.bfloat16)


def close(a, b) -> bool:  # float32 sums in another order: within a bf16 step
    return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -10)


def rotated_close(a, b) -> bool:
    """`close` for normed and rotated heads: a normed value a bf16 step off (3 in 307,200
    on AMD Zen 5) stays a step of the normed values (up to ~5) off through the rotation's
    a * cos + b * sin, also where that sum cancels to near zero."""
    return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -6)


def unfused_heads(qkv, h, kvh, d, qn, kn, cos, sin, norm=rms_norm):
    q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.reshape(-1, h, d), k.reshape(-1, kvh, d)
    if qn is not None:
        q, k = norm(q, qn, 1e-6), norm(k, kn, 1e-6)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@kernels
@pytest.mark.parametrize("t,h,kvh,d", [(1, 4, 1, 256), (7, 8, 2, 64), (300, 4, 1, 256)])
@pytest.mark.parametrize("norms", [True, False])
def test_qk_norm_rope_is_the_unfused_paths_bits(t, h, kvh, d, norms):
    from swaserve.kernels.norm import qk_norm_rope_bf16

    g = torch.Generator().manual_seed(t + d)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3).to(torch.bfloat16)
    qn = torch.rand(d, generator=g) + 0.5 if norms else None
    kn = torch.rand(d, generator=g) + 0.5 if norms else None
    inv, scale = rope_inv_freq(d, 10_000.0)
    cos, sin = rope_cos_sin(torch.arange(1000, 1000 + t), inv, torch.bfloat16, scale)
    q, k = qk_norm_rope_bf16(qkv, h, kvh, d, qn, kn, cos, sin, 1e-6)
    rq, rk = unfused_heads(qkv, h, kvh, d, qn, kn, cos, sin)
    assert q.shape == (t, h, d) and k.shape == (t, kvh, d)
    assert torch.equal(q, rq) and torch.equal(k, rk)  # the layer path's bits
    tq, tk = unfused_heads(qkv, h, kvh, d, qn, kn, cos, sin, torch_rms_norm)
    assert rotated_close(q, tq) and rotated_close(k, tk)  # and torch's values


@kernels
@pytest.mark.parametrize("with_delta_norm", [True, False])
@pytest.mark.parametrize("with_next_norm", [True, False])
def test_add_rms_norm_is_the_unfused_paths_bits(with_delta_norm, with_next_norm):
    from swaserve.kernels.norm import add_rms_norm_bf16

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 640, generator=g) * 5).to(torch.bfloat16)
    wide = (torch.randn(33, 1000, generator=g) * 2).to(torch.bfloat16)
    delta = wide[:, 100:740]  # rows 1000 apart
    wd = torch.rand(640, generator=g) + 0.5 if with_delta_norm else None
    wn = torch.rand(640, generator=g) + 0.5 if with_next_norm else None
    got_x, got_h = add_rms_norm_bf16(x, delta, wd, wn, 1e-6)
    ref_x = x + (rms_norm(delta, wd, 1e-6) if wd is not None else delta)
    assert torch.equal(got_x, ref_x)  # the layer path's bits
    assert close(got_x, x + (torch_rms_norm(delta, wd) if wd is not None else delta))
    if wn is None:
        assert got_h is None
    else:
        assert torch.equal(got_h, rms_norm(ref_x, wn, 1e-6))
        assert close(got_h, torch_rms_norm(ref_x, wn))  # and torch's values
    assert add_rms_norm_bf16(x.float(), delta.float(), wd, wn, 1e-6) is None


def test_fused_layer_ops_fall_back_to_torch_with_the_same_results():
    """float32 rows take torch's ops in add_rms_norm and the heads (the parity path)."""
    from swaserve.models.layers import add_rms_norm

    g = torch.Generator().manual_seed(2)
    x, d = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    got_x, got_h = add_rms_norm(x, d, w, w, 1e-6)

    def norm(t):  # RMSNorm written out, in float64
        t = t.double()
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
    ref_x = x + norm(d)
    assert got_x.dtype == torch.float32 and torch.allclose(got_x, ref_x, atol=1e-5)
    assert torch.allclose(got_h, norm(ref_x), atol=1e-5)


@kernels
def test_row_kernels_over_threads_give_one_threads_bits():
    """Norms, q/k norm + RoPE and GeGLU split their rows over the threads from
    ROWS_PARALLEL_MIN values on (a prompt chunk): row by row the same arithmetic, so the
    same bits as one thread, and a row computed in a call too small to split has the bits
    it gets inside a split one."""
    from swaserve.kernels import build
    from swaserve.kernels.gelu import gelu_tanh_mul_bf16
    from swaserve.kernels.norm import add_rms_norm_bf16, qk_norm_rope_bf16, rms_norm_bf16

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 640, generator=g) * 5).to(torch.bfloat16)
    d = (torch.randn(300, 640, generator=g) * 2).to(torch.bfloat16)
    w = torch.rand(640, generator=g) + 0.5
    qkv = (torch.randn(300, 6 * 256, generator=g) * 3).to(torch.bfloat16)
    qn, kn = torch.rand(256, generator=g) + 0.5, torch.rand(256, generator=g) + 0.5
    inv, scale = rope_inv_freq(256, 10_000.0)
    cos, sin = rope_cos_sin(torch.arange(300), inv, torch.bfloat16, scale)
    gu = (torch.randn(300, 2 * 2048, generator=g) * 4).to(torch.bfloat16)  # 2048 a row

    def run(rows):
        return (rms_norm_bf16(x[rows], w, 1e-6), *add_rms_norm_bf16(x[rows], d[rows], w, w, 1e-6),
                *qk_norm_rope_bf16(qkv[rows], 4, 1, 256, qn, kn, cos[rows], sin[rows], 1e-6),
                gelu_tanh_mul_bf16(gu[rows]))

    smallest = build.constants()["ROWS_PARALLEL_MIN"]
    assert 2048 < smallest <= 300 * 640  # one row is computed alone, 300 are split
    threads = torch.get_num_threads()
    runs = []
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            runs.append(run(slice(0, 300)))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert a is not None and torch.equal(a, b)
    for r in (0, 151, 299):  # alone, not split
        for alone, split in zip(run(slice(r, r + 1)), runs[1]):
            assert torch.equal(alone, split[r:r + 1])


@kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the AVX-512 loops are x86's: elsewhere the portable ones run")
def test_norm_kernels_portable_loops_give_the_avx512_loops_values(tmp_path, monkeypatch):
    """norm.c built for a CPU without AVX-512 (x86-64-v3) runs its portable loops: the
    same values as the AVX-512 loops, bit for bit where no sum of squares is taken (the
    residual add, RoPE alone) and at most one bf16 step apart after a norm (its sum adds
    in another order)."""
    import ctypes
    import shutil

    from swaserve.kernels import norm

    cc = shutil.which("cc") or shutil.which("gcc")
    lib_path = tmp_path / "norm-portable.so"
    assert build.compile_library(cc, Path(norm.__file__).with_name("norm.c"), lib_path,
                                 arch="x86-64-v3")
    lib, signatures = ctypes.CDLL(str(lib_path)), build.signatures()

    def portable(name):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = signatures[name]
        return fn

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 650, generator=g) * 5).to(torch.bfloat16)  # 650: a tail of 10
    d = (torch.randn(40, 650, generator=g) * 2).to(torch.bfloat16)
    w = torch.rand(650, generator=g) + 0.5
    qkv = (torch.randn(40, 6 * 72, generator=g) * 3).to(torch.bfloat16)  # halves of 36
    qn, kn = torch.rand(72, generator=g) + 0.5, torch.rand(72, generator=g) + 0.5
    inv, scale = rope_inv_freq(72, 10_000.0)
    cos, sin = rope_cos_sin(torch.arange(500, 540), inv, torch.bfloat16, scale)

    def run():
        return {"norm": norm.rms_norm_bf16(x, w, 1e-6),
                "add": norm.add_rms_norm_bf16(x, d, None, None, 1e-6)[0],
                "add + norms": norm.add_rms_norm_bf16(x, d, w, w, 1e-6),
                "rope": norm.qk_norm_rope_bf16(qkv, 4, 1, 72, None, None, cos, sin, 1e-6),
                "norms + rope": norm.qk_norm_rope_bf16(qkv, 4, 1, 72, qn, kn, cos, sin, 1e-6)}

    native = run()
    for entry, name in (("norm_entry", "rms_norm_bf16"), ("add_norm_entry", "add_rms_norm_bf16"),
                        ("rope_entry", "qk_norm_rope_bf16")):
        monkeypatch.setattr(norm, entry, lambda name=name: portable(name))
    ported = run()
    assert torch.equal(ported["add"], native["add"])
    assert all(torch.equal(a, b) for a, b in zip(ported["rope"], native["rope"]))
    for key in ("norm", "add + norms", "norms + rope"):
        a = ported[key] if isinstance(ported[key], tuple) else (ported[key],)
        b = native[key] if isinstance(native[key], tuple) else (native[key],)
        for p, n in zip(a, b, strict=True):
            assert torch.allclose(p.float(), n.float(), rtol=2 ** -7, atol=0), key
            assert (p == n).float().mean() > 0.98, key  # a few values at a rounding edge
