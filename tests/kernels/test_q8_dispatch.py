"""Which int8 kernel takes which rows: a tile kernel's argmax is the argmax of its own
sums, a prompt step takes one row-invariant kernel up to its rows, int8 activations
take q8_dpbf16's place, and a weight's own vnni limit moves where q8_vnni ends."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.kernels.conftest import amx, dpbf16, random_weight, vnni


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
