"""The int8 products with the GGUF's exact weights and integer activations: q8_vnni holds
activations as int16 per block of 32, q8_dpbusd as int8; each within its activations'
bound of float64's product, each row's sums its own whatever the batch, each block of
32 in its own range, a NaN kept to its row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import q8_0_blocks
from tests.kernels.conftest import k_quant_case, random_weight, vnni


def assert_int16_product(y: torch.Tensor, x: torch.Tensor, w: Q8Weight) -> float:
    """y is x @ w.T of the exact weights but for what int16 activations lose: each value
    within 2^-15 of its block of 32's largest (plus float32 round-off of the sums).
    Returns the largest error relative to the largest output."""
    wd = w.dequantize().double()
    exact = x.double() @ wd.T
    amax = x.double().abs().view(x.shape[0], -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
    bound = (amax @ wd.abs().T) * 2.0 ** -15 + 1e-6 * (x.double().abs() @ wd.abs().T)
    assert ((y.double() - exact).abs() <= bound).all()
    return (y.double() - exact).abs().max().item() / exact.abs().max().item()


@vnni
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (2, 48, 640), (3, 64, 96), (5, 1536, 640),
                                   (8, 640, 2048)])
def test_vnni_product_is_the_exact_weight_product(m, n, k):
    """Few rows multiply the GGUF's weights themselves (not their bf16 copy) by activations
    held as int16 per block of 32: ten times and more closer to float64's product of the
    exact weights than the tile unit's bf16 weights get."""
    w = random_weight(n, k, m).to_tiles()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    y = w.matmul(x, kernel="vnni")
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = assert_int16_product(y, x, w)
    if q8.amx_available():
        exact = x.double() @ w.dequantize().double().T
        amx_err = (w.matmul(x, kernel="amx").double() - exact).abs().max().item()
        assert amx_err / exact.abs().max().item() > 10 * err


@vnni
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_vnni_takes_k_quants_with_offsets_and_scales_per_16(kind, m):
    w, x = k_quant_case(kind, m)
    assert_int16_product(w.matmul(x, kernel="vnni"), x, w)


@vnni
def test_vnni_takes_q8_0_scales_as_float16_and_writes_bf16_as_its_sums_rounded_once():
    rng = np.random.default_rng(1)
    t = Q8Weight.from_q8_0_blocks(q8_0_blocks(rng.standard_normal((64, 640)).astype(np.float32)),
                                     64, 640).to_tiles()
    assert t.scales.dtype == torch.float16
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sums = t.matmul(x, kernel="vnni")
    assert_int16_product(sums, x, t)
    assert torch.equal(t.matmul(x, dtype=torch.bfloat16, kernel="vnni"), sums.to(torch.bfloat16))


@vnni
def test_vnni_rows_do_not_depend_on_their_batch_and_the_row_count_picks_the_kernel():
    w = random_weight(96, 640, 1).to_tiles()
    x = torch.randn(q8.VNNI_ROWS + 1, 640, generator=torch.Generator().manual_seed(2)).to(
        torch.bfloat16)
    whole = w.matmul(x[:q8.VNNI_ROWS])
    assert torch.equal(whole, w.matmul(x[:q8.VNNI_ROWS], kernel="vnni"))
    for lo, hi in [(0, 1), (1, 3), (2, q8.VNNI_ROWS)]:
        assert torch.equal(w.matmul(x[lo:hi]), whole[lo:hi])
    if q8.amx_available():  # one row more: the tile unit
        assert torch.equal(w.matmul(x), w.matmul(x, kernel="amx"))
    rows = q8.vnni_rows()
    assert q8.tile_kernel(rows) == "vnni" and q8.tile_kernel(rows + 1) != "vnni"
    # more rows than one pass keeps in registers (a decode step without AMX nor AVX-512
    # BF16 goes up to VNNI_SPLIT_ROWS, an explicit "vnni" any): passes of VNNI_CHUNK and a
    # last shorter one, each row's sums its own wherever it falls
    x = torch.randn(3 * q8.VNNI_CHUNK + 5, 640,
                    generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    many = w.matmul(x, kernel="vnni")
    assert many is not None
    assert_int16_product(many, x, w)
    chunk = q8.VNNI_CHUNK
    for lo, hi in [(0, chunk), (3, chunk + 3), (chunk - 1, 2 * chunk + 4), (len(x) - 1, len(x))]:
        assert torch.equal(w.matmul(x[lo:hi], kernel="vnni"), many[lo:hi])
    # rows in spans a thread keeps in L2 (VNNI_SPAN_BYTES: 16 rows at k = 8192)
    wide = random_weight(32, 8192, 5).to_tiles()
    x = torch.randn(29, 8192, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    spans = wide.matmul(x, kernel="vnni")
    assert_int16_product(spans, x, wide)
    for lo, hi in [(0, 1), (15, 17), (16, 29)]:
        assert torch.equal(wide.matmul(x[lo:hi], kernel="vnni"), spans[lo:hi])


@vnni
def test_vnni_activation_blocks_keep_their_own_range_zeros_and_nans():
    """Each block of 32 gets its own power of two: blocks from 1e-30 to 1e30 in one row,
    and rows of tiny or huge values alone, keep int16's precision; a zero row gives zeros;
    a NaN (or an infinity) makes its own row NaN, no other."""
    w = random_weight(32, 256, 4).to_tiles()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    x[0] *= (10.0 ** torch.arange(-30, 31, 60 / 7)).repeat_interleave(32)
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3, 37] = 1e6  # a block whose other values are far below its largest
    x[4] = 0
    x[5, 100] = float("nan")
    x[6, 3] = float("inf")
    x = x.to(torch.bfloat16)
    y = w.matmul(x, kernel="vnni")
    assert_int16_product(y[:4], x[:4], w)
    assert torch.equal(y[4], torch.zeros(32))
    assert y[5:].isnan().all() and not y[:5].isnan().any()


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] bf16 as q8_dpbusd writes it, in float64: int8 values per block of 32 (x
    times 127 / the block's largest |x| in float32, rounded to nearest even) and each
    block's scale (that largest / 127), [m, k / 32]."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax.clamp_min(1e-30)  # (127.0 / t: 1 / t * 127)
    xq = torch.round(xf * inv)
    return xq.view(x.shape).double(), (amax / 127.0).squeeze(-1).double()


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, w: Q8Weight) -> float:
    """y is x @ w.T of the exact weights but for what int8 activations lose: half a step of
    each block's scale times the weights' |w| (plus float32 round-off of the sums), and
    within float32 round-off of the float64 product of those int8 activations (offsets
    taken off with the exact sums of x). Returns the largest error relative to the largest
    output."""
    wd = w.dequantize().double()
    exact = x.double() @ wd.T
    xq, sx = int8_activations(x)
    step = sx.repeat_interleave(32, dim=1)
    roundoff = 1e-6 * (x.double().abs() @ wd.abs().T)
    assert ((y.double() - exact).abs() <= 0.5 * step @ wd.abs().T + roundoff).all()
    _, scales, offsets = w.rows()
    g = w.group
    wq = wd if offsets is None else wd + offsets.double().repeat_interleave(g, dim=1)
    emulated = (xq * step) @ wq.T
    if offsets is not None:
        sums = x.double().view(x.shape[0], -1, g).sum(-1)
        emulated -= sums @ offsets.double().T
    assert ((y.double() - emulated).abs() <= roundoff + 1e-5 * exact.abs().max()).all()
    return (y.double() - exact).abs().max().item() / exact.abs().max().item()


@vnni
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 48, 640), (12, 64, 96), (13, 1536, 640),
                                   (40, 640, 2048)])
def test_dpbusd_product_is_within_int8_activations_bound(m, n, k):
    """q8_dpbusd multiplies the exact weights by activations held as int8 per block of 32:
    within half a step of each block's scale of float64's product, and measurably further
    from it than bf16 activations are (so the int8 path is the one that ran)."""
    w = random_weight(n, k, m).to_tiles()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    y = w.matmul(x, kernel="dpbusd")
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = assert_int8_product(y, x, w)
    assert err > 1e-3  # int16 activations: ~1e-5
    bf16 = w.matmul(x, dtype=torch.bfloat16, kernel="dpbusd")
    assert torch.equal(bf16, y.to(torch.bfloat16))


@vnni
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 19, 32])
def test_dpbusd_takes_k_quants_with_offsets_and_scales_per_16(kind, m):
    w, x = k_quant_case(kind, m)
    assert_int8_product(w.matmul(x, kernel="dpbusd"), x, w)


@vnni
@pytest.mark.parametrize("k", [640, 2048])
def test_dpbusd_rows_do_not_depend_on_their_batch(k):
    """Rows in chunks of 12 over a column block rewritten once: a row's sums are its own
    wherever it falls in the call."""
    w = random_weight(96, k, 1).to_tiles()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = w.matmul(x, kernel="dpbusd")
    for lo, hi in [(0, 1), (3, 20), (11, 13), (7, 40)]:
        assert torch.equal(w.matmul(x[lo:hi], kernel="dpbusd"), whole[lo:hi])


@vnni
def test_dpbusd_activation_blocks_keep_their_own_range_zeros_and_nans():
    """Each block of 32 gets its own scale: blocks from 1e-30 to 1e30 in one row, a block
    of values under 2^-100 (whose 127 / largest would overflow float32), rows of tiny or
    huge values, keep int8's relative precision; a zero row gives zeros; a NaN (or an
    infinity) makes its own row NaN, no other."""
    w = random_weight(32, 256, 4).to_tiles()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    x[0] *= (10.0 ** torch.arange(-30, 31, 60 / 7)).repeat_interleave(32)
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3, 37] = 1e6  # a block whose other values are far below its largest
    x[4] = 0
    x[5, 100] = float("nan")
    x[6, 3] = float("inf")
    x[7, 32:64] *= 2.0 ** -110
    x = x.to(torch.bfloat16)
    y = w.matmul(x, kernel="dpbusd")
    for r in (0, 1, 2, 3, 7):
        assert_int8_product(y[r:r + 1], x[r:r + 1], w)
    assert torch.equal(y[4], torch.zeros(32))
    assert y[5:7].isnan().all() and not y[:5].isnan().any() and not y[7].isnan().any()
