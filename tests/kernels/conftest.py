"""What the kernel tests share: the skip marks of the int8 tile kernels (amx, dpbf16,
vnni) and random int8 weights for them (test_q8_*.py), and random int8 heads with hidden
rows for the LM head's screen (test_head_screen_*.py)."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8, screen
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


def random_head(n: int, k: int, seed: int, offsets: bool = False, group: int = 32):
    """A tiled int8 head of random Q8_0-like columns (or Q4_K-like ones with offsets, or
    Q6_K's groups of 16), its columns' scales spread over 30x like a real head's."""
    g = torch.Generator().manual_seed(seed)
    if offsets:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 29 + 1) * 1e-3
    scales = scales.half().float()  # exact in float16, as a GGUF's are
    offs = torch.rand(n, k // group, generator=g) * 0.01 if offsets else None
    return Q8Weight(q, scales, offs, group=group).to_tiles()


def hidden_rows(m: int, k: int, seed: int, outliers: int = 8) -> torch.Tensor:
    """bf16 rows with a few channels 5-20x larger than the rest, as a final hidden state's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    big = torch.randperm(k, generator=g)[:outliers]
    x[:, big] *= torch.rand(outliers, generator=g) * 15 + 5
    return x.bfloat16()


def built_screen(head, k: int) -> screen.HeadScreen:
    s = screen.HeadScreen.for_head(head)
    assert s is not None and not s.built
    assert s.argmax(hidden_rows(screen.BUILD_ROWS, k, seed=99)) is not None and s.built
    return s
