"""What the kernel tests share: the skip marks of the int8 tile kernels (amx, dpbf16,
vnni) and random int8 weights for them (test_q8_*.py)."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import k_quant_blocks, weight_from

amx = pytest.mark.skipif(not q8.amx_available(), reason="no AMX (or no compiler) here")
dpbf16 = pytest.mark.skipif(not q8.dpbf16_available(),
                            reason="no AVX-512 BF16 (or no compiler) here")
vnni = pytest.mark.skipif(not q8.vnni_available(), reason="no AVX-512 VNNI (or no compiler)")


def random_weight(n: int, k: int, seed: int) -> Q8Weight:
    g = torch.Generator().manual_seed(seed)
    return Q8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                       torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4)


def k_quant_case(kind: str, m: int) -> tuple[Q8Weight, torch.Tensor]:
    """A tiled [48, 1024] K-quant weight and m rows of bf16 activations."""
    w = weight_from(kind, k_quant_blocks(kind, 48, 1024, m), 48, 1024).to_tiles()
    return w, torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)

