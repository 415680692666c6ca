"""The int8 LM head: Q8_0 blocks read as int8 + scales are the GGUF's weights exactly, and
the kernel multiplies them to float32 round-off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import drive, k_quant_blocks, q8_0_blocks, weight_from


def test_blocks_read_as_int8_and_scales_are_the_dequantized_weights():
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = q8_0_blocks(w)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    got = Q8Weight.from_q8_0_blocks(raw, 48, 96).dequantize().numpy()
    assert np.array_equal(got, ref)


@pytest.mark.skipif(not q8.available(), reason="no C compiler for the kernel")
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_matvec_matches_float64(m):
    g = torch.Generator().manual_seed(m)
    w = Q8Weight(torch.randint(-127, 128, (1000, 640), generator=g, dtype=torch.int8),
                    torch.rand(1000, 20, generator=g) * 0.02)
    x = torch.randn(m, 640, generator=g).to(torch.bfloat16)
    y = w.matmul(x)
    ref = x.double() @ w.dequantize().double().T
    assert y.dtype == torch.float32 and y.shape == (m, 1000)
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_read_as_int8_are_the_dequantized_weights(kind):
    import gguf

    raw = k_quant_blocks(kind, 32, 512, 0)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(32, 512)
    w = weight_from(kind, raw, 32, 512)
    assert (w.group, w.offsets is not None) == ((32, True) if kind == "Q4_K" else (16, False))
    assert not w.plain and not w.takes(torch.zeros(1, 512))  # q8_matvec takes plain only
    assert np.array_equal(w.dequantize().numpy(), ref)
    t = w.to_tiles()
    assert np.array_equal(t.dequantize().numpy(), ref)
    assert all(a is b or torch.equal(a, b) for a, b in zip(t.rows(), w.rows()))


def random_weight(n: int, k: int, seed: int) -> Q8Weight:
    g = torch.Generator().manual_seed(seed)
    return Q8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                       torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4)


def test_tiles_hold_the_same_weight():
    w = random_weight(48, 96, 0)
    t = w.to_tiles()
    assert t.tiled and t.shape == w.shape and t.q.shape == (3, 3, 16, 16, 2)
    q, s, o = t.rows()
    assert torch.equal(q, w.q) and torch.equal(s, w.scales) and o is None
    # block (n, b), pair p, output j, value i is weight [16 n + j, 32 b + 2 p + i]
    assert t.q[2, 1, 5, 7, 1] == w.q[2 * 16 + 7, 1 * 32 + 2 * 5 + 1]
    assert torch.equal(t.dequantize(), w.dequantize())
    with pytest.raises(ValueError, match="multiple of 16"):
        random_weight(40, 32, 0).to_tiles()
    with pytest.raises(ValueError, match="row-major"):
        Q8Weight.stack([t, w])


def k_quant_case(kind: str, m: int) -> tuple[Q8Weight, torch.Tensor]:
    """A tiled [48, 1024] K-quant weight and m rows of bf16 activations."""
    w = weight_from(kind, k_quant_blocks(kind, 48, 1024, m), 48, 1024).to_tiles()
    return w, torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)


amx = pytest.mark.skipif(not q8.amx_available(), reason="no AMX (or no compiler) here")
dpbf16 = pytest.mark.skipif(not q8.dpbf16_available(),
                            reason="no AVX-512 BF16 (or no compiler) here")
# the two kernels that multiply the tiles widened to bf16: on the tile unit, and (without
# one) with AVX-512 BF16 dot products
bf16_tiles = pytest.mark.parametrize("kernel", [pytest.param("amx", marks=amx),
                                                pytest.param("dpbf16", marks=dpbf16)])


@bf16_tiles
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 48, 640), (16, 64, 96), (17, 32, 640),
                                   (32, 1536, 640), (33, 80, 64), (70, 256, 640)])
def test_bf16_tiles_product_is_the_bf16_weight_product_in_float32(m, n, k, kernel):
    """The kernel multiplies bf16(scale * q), the values of the bf16 copy, by bf16
    activations with float32 sums: float32 round-off from a float64 product of the same
    values, and measurably not the product of the unrounded weights."""
    w = random_weight(n, k, m).to_tiles()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    y = w.matmul(x, kernel=kernel)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = x.double() @ w.dequantize().to(torch.bfloat16).double().T
    unrounded = x.double() @ w.dequantize().double().T
    tol = 1e-6 * k ** 0.5 * ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() < tol
    assert (unrounded - ref).abs().max().item() > 10 * tol


@bf16_tiles
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 19, 32])
def test_bf16_tiles_take_k_quants_with_offsets_and_scales_per_16(kind, m, kernel):
    w, x = k_quant_case(kind, m)
    y = w.matmul(x, kernel=kernel)
    ref = x.double() @ w.dequantize().to(torch.bfloat16).double().T
    assert (y.double() - ref).abs().max().item() < 1e-6 * 32 * ref.abs().max().item()


@bf16_tiles
def test_bf16_tiles_take_q8_0_scales_as_float16_exactly(kernel):
    rng = np.random.default_rng(0)
    w = Q8Weight.from_q8_0_blocks(q8_0_blocks(rng.standard_normal((64, 640)).astype(np.float32)),
                                     64, 640)
    t = w.to_tiles()
    assert t.scales.dtype == torch.float16 and torch.equal(t.dequantize(), w.dequantize())
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = x.double() @ w.dequantize().to(torch.bfloat16).double().T
    y = t.matmul(x, kernel=kernel)
    assert (y.double() - ref).abs().max().item() < 1e-6 * 20 * ref.abs().max().item()


@bf16_tiles
@pytest.mark.parametrize("k", [640, 2048])
def test_bf16_tiles_rows_do_not_depend_on_their_batch(kernel, k):
    """Past 32 rows q8_amx widens a pair of column blocks over all of K (2048: 128 KB,
    past L1) and runs every row chunk over it: the same sums in the same order as 32 rows."""
    w = random_weight(96, k, 1).to_tiles()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = w.matmul(x, kernel=kernel)
    for lo, hi in [(0, 1), (3, 20), (7, 40), (31, 33)]:
        assert torch.equal(w.matmul(x[lo:hi], kernel=kernel), whole[lo:hi])


@bf16_tiles
@pytest.mark.parametrize("m,n", [(1, 48), (17, 4096), (32, 80)])
def test_bf16_tiles_bf16_results_are_their_float32_sums_rounded_once(m, n, kernel):
    w = random_weight(n, 640, m).to_tiles()
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    sums = w.matmul(x, kernel=kernel)
    y = w.matmul(x, dtype=torch.bfloat16, kernel=kernel)
    assert y.dtype == torch.bfloat16 and torch.equal(y, sums.to(torch.bfloat16))
    into = torch.empty(m, n, dtype=torch.bfloat16)
    assert w.matmul(x, out=into, kernel=kernel) is into and torch.equal(into, y)
    with pytest.raises(ValueError, match="out must be contiguous"):
        w.matmul(x, out=torch.empty(m, n, dtype=torch.float16), kernel=kernel)


vnni = pytest.mark.skipif(not q8.vnni_available(), reason="no AVX-512 VNNI (or no compiler)")


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


@vnni
def test_int8_activations_take_dpbf16s_place_at_any_rows():
    """A weight with `int8_activations` multiplies on q8_dpbusd where it would take
    q8_dpbf16 (decode steps past q8_vnni's rows, prompt steps) and past PROMPT_DPBF16_ROWS
    too (where the plain weight declines for bf16); q8_vnni's rows stay on q8_vnni."""
    if q8.amx_available() or not q8.dpbf16_available():
        pytest.skip("q8_dpbusd stands in for q8_dpbf16 only (no AMX, AVX-512 BF16)")
    w = random_weight(32, 64, 2).to_tiles()
    w.int8_activations = True
    rows = q8.vnni_rows()
    assert w.kernel_for(rows) == "vnni" and w.kernel_for(rows + 1) == "dpbusd"
    assert w.kernel_for(1, "dpbf16") == "dpbusd"
    x = torch.randn(q8.PROMPT_DPBF16_ROWS + 1, 64,
                    generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert w.takes(x, "dpbf16")
    assert torch.equal(w.matmul(x, kernel="dpbf16"), w.matmul(x, kernel="dpbusd"))
    assert torch.equal(w.argmax(x[:5], "dpbf16"), w.matmul(x[:5], kernel="dpbusd").argmax(-1))
    plain = random_weight(32, 64, 2).to_tiles()
    assert plain.kernel_for(rows + 1) == "dpbf16" and not plain.takes(x, "dpbf16")
    assert q8.same_kernel_rows(rows, int8=True) == rows


@pytest.mark.skipif(not q8.available(), reason="no C compiler for the kernel")
def test_matvec_gives_bf16_as_a_cast_of_its_float32_sums():
    g = torch.Generator().manual_seed(5)
    w = Q8Weight(torch.randint(-127, 128, (64, 640), generator=g, dtype=torch.int8),
                    torch.rand(64, 20, generator=g) * 0.02)
    x = torch.randn(2, 640, generator=g).to(torch.bfloat16)
    assert torch.equal(w.matmul(x, dtype=torch.bfloat16), w.matmul(x).to(torch.bfloat16))
    into = torch.empty(2, 64, dtype=torch.bfloat16)
    assert w.matmul(x, out=into) is into and torch.equal(into, w.matmul(x).to(torch.bfloat16))


@amx
def test_tiles_take_bf16_only_and_say_so():
    w = random_weight(32, 64, 3).to_tiles()
    x = torch.randn(2, 64)
    assert not w.takes(x) and w.matmul(x) is None
    assert w.takes(x.to(torch.bfloat16))
    # any number of rows (q8_amx takes decode steps of any size)
    assert w.takes(x[:0].new_zeros(256, 64).bfloat16()) == q8.amx_available()
    assert w.for_activations(torch.bfloat16) is w
    assert not random_weight(32, 64, 3).for_activations(torch.float16).tiled


def test_more_rows_than_the_kernel_takes_fall_back():
    if not q8.available():
        pytest.skip("no C compiler for the kernel")
    w = Q8Weight(torch.ones(64, 32, dtype=torch.int8), torch.ones(64, 1))
    took = w.matmul(torch.ones(q8.MAX_ROWS, 32))
    assert took is not None and torch.equal(took, torch.full((q8.MAX_ROWS, 64), 32.0))
    assert w.matmul(torch.ones(q8.MAX_ROWS + 1, 32)) is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="K % 32"):
        Q8Weight(torch.zeros(4, 30, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales"):
        Q8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3))


def test_an_unwritable_cache_leaves_the_kernel_off_not_the_engine_broken(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from pathlib import Path

    from swaserve.kernels import build

    source = Path(q8.__file__).with_name("q8.c")
    assert build.compile_library("cc", source, blocker / "kernels" / "q8.so") is False


def test_one_header_holds_every_kernels_signature_and_flags():
    """kernels.h is the one place for prototypes and shared flags: every exported symbol of
    every kernel library is declared there, and the bindings take their types from it."""
    import re
    from pathlib import Path

    from swaserve.kernels import build

    sig = build.signatures()
    here = Path(q8.__file__).parent
    for c in sorted(here.glob("*.c")):
        text = re.sub(r"/\*.*?\*/", "", c.read_text(), flags=re.S)
        exported = re.findall(r"^(?:int|void) (\w+)\(", text, re.M)
        assert exported and set(exported) <= set(sig), (c.name, set(exported) - set(sig))
        lib = build.load(c.stem)
        if lib is None:
            continue
        for name in set(exported):
            fn = build.function(c.stem, name)
            assert fn.argtypes == sig[name][1] and fn.restype == sig[name][0]
    flags = build.constants()
    assert flags["Q8_BF16_OUT"] == 4 and q8.MAX_ROWS == flags["Q8_MAX_ROWS"]
    assert len(sig["decode_layers"][1]) == 15 and sig["rms_norm_bf16"][0] is None


@pytest.mark.parametrize("kernel", [pytest.param("amx", marks=amx),
                                    pytest.param("dpbf16", marks=dpbf16),
                                    pytest.param("vnni", marks=vnni),
                                    pytest.param("dpbusd", marks=vnni)])
@pytest.mark.parametrize("m,n", [(1, 4096), (3, 1552), (7, 4096), (13, 48), (33, 8192)])
def test_tile_argmax_is_the_argmax_of_its_sums(kernel, m, n):
    """Q8_ARGMAX_OUT on each tile kernel: the first index of each row's largest float32
    sum, as argmax of what that kernel writes; a tie (outputs 3 and n/2 have the same
    weights, and row 1 makes them the largest) goes to the first, a NaN sum declines."""
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-128, 128, (n, 64), generator=g, dtype=torch.int8)
    q[3] = q[n // 2] = 127
    scales = torch.rand(n, 2, generator=g) * 0.02 + 1e-4
    scales[3] = scales[n // 2] = 0.05
    w = Q8Weight(q, scales).to_tiles()
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    x[0] = 0  # every sum 0: index 0
    if m > 1:
        x[1] = 1
    sums = w.matmul(x, kernel=kernel)
    got = w.argmax(x, kernel)
    assert torch.equal(got, sums.argmax(-1))
    assert got[0].item() == 0 and (m == 1 or got[1].item() == 3)
    if tile_kernel_default := q8.tile_kernel(m):  # a decode step's kernel for m rows
        assert torch.equal(w.argmax(x), w.matmul(x, kernel=tile_kernel_default).argmax(-1))
    x[m - 1, 5] = float("nan")
    assert w.argmax(x, kernel) is None


def test_a_prompt_step_takes_one_row_invariant_kernel_up_to_its_rows():
    """Steps with prompt rows multiply on q8_amx, or without AMX on q8_dpbf16 (each row's
    sums its own whatever the call), up to that kernel's PROMPT_*_ROWS rows; past them in
    bf16 (the weight declines), while `matmul` itself takes any rows."""
    kernel = q8.prompt_kernel()
    assert kernel == ("amx" if q8.amx_available() or not q8.dpbf16_available() else "dpbf16")
    if q8.tile_kernel(1, kernel) is None:
        pytest.skip("no prompt step's tile kernel here")
    limit = q8.PROMPT_AMX_ROWS if kernel == "amx" else q8.PROMPT_DPBF16_ROWS
    t = random_weight(32, 64, 2).to_tiles()
    x = torch.randn(limit + 1, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert t.takes(x[:limit], kernel) and not t.takes(x, kernel)
    assert q8.tile_kernel(limit + 1, kernel, any_rows=True) == kernel
    alone = t.matmul(x[:3], kernel=kernel)
    assert torch.equal(t.matmul(x[:limit], kernel=kernel)[:3], alone)  # rows are their own


def test_argmax_declines_where_no_tile_kernel_takes_the_rows():
    w = random_weight(64, 64, 0)  # rows layout: not the tiles' kernels
    assert w.argmax(torch.zeros(8, 64, dtype=torch.bfloat16)) is None
    if q8.amx_available():  # a prompt step past PROMPT_AMX_ROWS multiplies in bf16
        t = w.to_tiles()
        x = torch.zeros(q8.PROMPT_AMX_ROWS + 1, 64, dtype=torch.bfloat16)
        assert not t.takes(x, "amx") and t.argmax(x, "amx") is None
        assert t.argmax(x[:q8.PROMPT_AMX_ROWS], "amx") is not None


@vnni
def test_a_weight_with_its_own_vnni_limit_takes_q8_vnni_up_to_it():
    """`vnni_limit` (an LM head's: `head_vnni_rows()`) moves where a tiled weight leaves
    q8_vnni: up to it the sums and argmaxes are q8_vnni's bit for bit, past it the default
    kernel's; a decode step may grow with drafts only within the kernel its rows take."""
    w = random_weight(64, 64, 1)
    w.vnni_limit = limit = q8.vnni_rows() + 4
    w = w.to_tiles()  # the tiles keep it
    assert w.vnni_limit == limit
    for m in (q8.vnni_rows() + 1, limit):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert w.takes(x) and torch.equal(w.matmul(x), w.matmul(x, kernel="vnni"))
        assert torch.equal(w.argmax(x), w.matmul(x, kernel="vnni").argmax(-1))
        assert q8.same_kernel_rows(m, True, limit) == limit
    x = torch.randn(limit + 1, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    past = q8.tile_kernel(limit + 1)
    assert past != "vnni" and q8.same_kernel_rows(limit + 1, True, limit) == 1 << 62
    if past is not None:
        assert torch.equal(w.matmul(x), w.matmul(x, kernel=past))


@vnni
def test_the_models_head_takes_its_own_vnni_limit(tmp_path):
    """A model's tiled int8 head gets `head_vnni_rows()` (past `vnni_rows()` where the rows
    past it would go to q8_dpbf16), or where its screen runs at most screen.VNNI_ROWS (the
    screen's tokens are faster past them), and drafts may grow a step only within both
    limits."""
    from swaserve.engine.engine import Engine
    from swaserve.kernels import screen
    from tests.conftest import HYBRID, write_tiny_gemma3

    write_tiny_gemma3(tmp_path, HYBRID, seed=3)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256)
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    int8 = Q8Weight(torch.round(head / scales).to(torch.int8), scales).to_tiles()
    base = q8.head_vnni_rows()
    assert base >= q8.vnni_rows()
    if not q8.amx_available() and q8.dpbf16_available():
        assert base == max(q8.HEAD_VNNI_ROWS, q8.vnni_rows())
    else:
        assert base == q8.vnni_rows()
    for screened in (False, True):
        eng.model.use_q8({"lm_head": int8}, head_screen=screened)
        limit = base
        if screened and eng.model.head.screen is not None:
            limit = min(base, screen.VNNI_ROWS)
            assert limit < base or not screen.available()
        assert eng.model.head.q8.vnni_limit == limit
        assert eng.model.same_numerics_rows(1) == limit
        assert eng.model.same_numerics_rows(limit + 1) == 1 << 62


@pytest.mark.skipif(q8.tile_kernel(1) is None, reason="no tile kernel (or no compiler) here")
def test_a_greedy_batch_takes_the_heads_argmaxes_with_the_same_tokens(tmp_path, monkeypatch):
    """A bf16 engine with an int8 LM head: a batch of plain greedy rows (one row up to nine,
    so q8_vnni's rows and past them) gets its tokens from the head's argmaxes, and they are
    the tokens of the logits path (taken when logits are logged, or when a row samples)."""
    from swaserve.engine.engine import Engine
    from swaserve.sampling.params import SamplingParams
    from tests.conftest import HYBRID, random_prompt, write_tiny_gemma3

    write_tiny_gemma3(tmp_path, HYBRID, seed=9)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256,
                 prefix_cache=False)  # each run computes its prompts alike
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    q = torch.round(head / scales).to(torch.int8)
    eng.model.use_q8({"lm_head": Q8Weight(q, scales).to_tiles()})
    taken = []  # the rows of each step whose tokens came from the head's argmaxes
    real = Q8Weight.argmax

    def argmax(self, x, kernel=None):
        tokens = real(self, x, kernel)
        if tokens is not None:
            taken.append(x.shape[0])
        return tokens

    monkeypatch.setattr(Q8Weight, "argmax", argmax)
    # 4 to 20 tokens: the batch shrinks from nine rows to one as requests finish
    greedy = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(9)]
    prompts = [random_prompt(5 + 3 * i, i) for i in range(9)]

    def run(log: bool, params: list[SamplingParams]):
        eng.logits_log = [] if log else None
        reqs = [eng.add_request(p, q)[0] for p, q in zip(prompts, params)]
        drive(eng)
        return [r.output_token_ids for r in reqs]

    fast = run(False, greedy)
    assert 1 in taken and 9 in taken
    taken.clear()
    assert run(True, greedy) == fast and not taken
    seeded = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    assert run(False, [seeded] + greedy[1:])[1:] == fast[1:]
    assert taken and max(taken) < 9  # only the steps after the sampled row finished


def test_greedy_rows_beside_sampled_rows_take_argmaxes_with_the_same_tokens(tmp_path,
                                                                             monkeypatch):
    """A bf16 engine with an int8 LM head, a batch mixing plain greedy rows with seeded
    sampling, top-k and logprob rows (9 rows shrinking to 1): the greedy rows' tokens come
    from the head's argmaxes and the others' from their own logits (a SPLIT HeadOutput), each on
    the kernel the whole step's head would take, so every request's tokens and logprobs
    are those of the path that computes every row's logits (taken when logits are
    logged)."""
    from swaserve.engine.engine import Engine
    from swaserve.models.head import LMHead
    from swaserve.sampling.params import SamplingParams
    from tests.conftest import HYBRID, random_prompt, write_tiny_gemma3

    if q8.tile_kernel(9) is None:
        pytest.skip("no int8 tile kernel takes 9 decode rows here")
    write_tiny_gemma3(tmp_path, HYBRID, seed=9)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256,
                 prefix_cache=False)
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    eng.model.use_q8({"lm_head": Q8Weight(torch.round(head / scales).to(torch.int8),
                                             scales).to_tiles()})
    # past 4 rows another kernel than q8_vnni: a part of a step (3 greedy, 6 other rows)
    # on the kernel its own row count picks would round as the whole step's does not
    eng.model.head.q8.vnni_limit = 4
    splits = []
    real = LMHead.split

    def split(self, x, ctx):
        out = real(self, x, ctx)
        if out is not None:
            splits.append((len(out.chosen), x.shape[0]))
        return out

    monkeypatch.setattr(LMHead, "split", split)
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=5),
             dict(temperature=1.0, top_k=4, seed=6), dict(temperature=0, logprobs=3)]
    params = [SamplingParams(**kinds[i % 4], max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(9)]
    prompts = [random_prompt(5 + 3 * i, i) for i in range(9)]

    def run(log: bool):
        eng.logits_log = [] if log else None
        reqs = [eng.add_request(p, q)[0] for p, q in zip(prompts, params)]
        drive(eng)
        return [(r.output_token_ids, r.logprobs) for r in reqs]

    fast = run(False)
    assert (3, 9) in splits  # rows 0, 4, 8 greedy beside 6 that are not
    splits.clear()
    assert run(True) == fast and not splits


@pytest.mark.skipif(not q8.vnni_available(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q8_0", "Q6_K"])
def test_vnni_reads_q5_0_and_q4_k_packed_with_the_same_bits(kind):
    """Tiles of Q5_0 (q in -16..15) and Q4_K (0..15) values are also kept in 5 and 4 bits,
    which q8_vnni reads instead of the int8 tiles: 5/8 and half the bytes, the same sums
    bit for bit; Q8_0's and Q6_K's (a scale per 16) stay int8."""
    import gguf

    w = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    if kind in ("Q5_0", "Q8_0"):
        read = getattr(Q8Weight, f"from_{kind.lower()}_blocks")
        weight = read(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind)), 64, 512)
    else:
        weight = weight_from(kind, k_quant_blocks(kind, 64, 512, 4), 64, 512)
    t = weight.to_tiles()
    if kind in ("Q8_0", "Q6_K"):
        assert t.packed is None
        return
    packed, _ = t.packed
    assert packed.numel() == t.q.numel() * {"Q5_0": 5, "Q4_K": 4}[kind] // 8
    for m in range(1, q8.VNNI_ROWS + 1):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got = t.matmul(x, kernel="vnni")
        keep, t.packed = t.packed, None
        want = t.matmul(x, kernel="vnni")
        t.packed = keep
        assert torch.equal(got, want), m
