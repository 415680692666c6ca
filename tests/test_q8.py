"""The int8 LM head: Q8_0 blocks read as int8 + scales are the GGUF's weights exactly, and
the kernel multiplies them to float32 round-off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import q8


def q8_0_blocks(w: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)


def test_blocks_read_as_int8_and_scales_are_the_dequantized_weights():
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = q8_0_blocks(w)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    got = q8.Q8Weight.from_q8_0_blocks(raw, 48, 96).dequantize().numpy()
    assert np.array_equal(got, ref)


@pytest.mark.skipif(not q8.available(), reason="no C compiler for the kernel")
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_matvec_matches_float64(m):
    g = torch.Generator().manual_seed(m)
    w = q8.Q8Weight(torch.randint(-127, 128, (1000, 640), generator=g, dtype=torch.int8),
                    torch.rand(1000, 20, generator=g) * 0.02)
    x = torch.randn(m, 640, generator=g).to(torch.bfloat16)
    y = w.matvec(x)
    ref = x.double() @ w.dequantize().double().T
    assert y.dtype == torch.float32 and y.shape == (m, 1000)
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_more_rows_than_the_kernel_takes_fall_back():
    w = q8.Q8Weight(torch.zeros(64, 32, dtype=torch.int8), torch.ones(64, 1))
    assert w.matvec(torch.zeros(q8.MAX_ROWS + 1, 32)) is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="K % 32"):
        q8.Q8Weight(torch.zeros(4, 30, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales"):
        q8.Q8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3))


def test_an_unwritable_cache_leaves_the_kernel_off_not_the_engine_broken(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from pathlib import Path

    from swaserve.kernels import build

    source = Path(q8.__file__).with_name("q8_matvec.c")
    assert build.compile_library("cc", source, blocker / "kernels" / "q8.so") is False


def test_rms_norm_kernel_matches_torch_on_rows_and_head_views():
    import torch.nn.functional as F

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
