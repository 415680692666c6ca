"""The int8 products with bf16 weights: q8_matvec (plain rows, float32 activations), and
the tiles widened to bf16 on the tile unit (q8_amx) or with AVX-512 BF16 dot products
(q8_dpbf16): float32 round-off from float64's product of the same values, each row's
sums its own whatever the batch, bf16 results their float32 sums rounded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import q8_0_blocks
from tests.kernels.conftest import amx, dpbf16, k_quant_case, random_weight


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
