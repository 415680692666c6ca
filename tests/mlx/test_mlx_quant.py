"""GGUF weights in MLX's quantized format (mlx/quant.py): every format that maps is the
file's weights exactly, in MLX's own packing; Q6_K (a scale per 16) stays dense."""

from __future__ import annotations

import numpy as np
import pytest

from swaserve.kernels.q8_weight import Q8Weight
from swaserve.mlx import available
from tests.conftest import k_quant_blocks, q8_0_blocks, weight_from

pytestmark = pytest.mark.skipif(not available(), reason="mlx is not installed "
                                "(pip install \"mlx[cpu]\" on Linux, mlx on Apple silicon)")


def _weights() -> dict:
    import gguf

    w = np.random.default_rng(0).standard_normal((48, 640)).astype(np.float32)
    q8_0 = Q8Weight.from_q8_0_blocks(q8_0_blocks(w), 48, 640)
    q5_0 = Q8Weight.from_q5_0_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0),
                                        48, 640)
    return {"Q8_0": (q8_0, 8), "Q5_0": (q5_0, 5),
            "Q4_K": (weight_from("Q4_K", k_quant_blocks("Q4_K", 32, 512, 1), 32, 512), 4),
            "Q5_0 + Q8_0 rows": (Q8Weight.stack([q5_0, q8_0]), 8)}


@pytest.mark.parametrize("kind", list(_weights()))
def test_formats_that_map_are_the_files_weights_exactly(kind):
    import mlx.core as mx

    from swaserve.mlx.quant import GROUP, quantized

    w, bits = _weights()[kind]
    q = quantized(w)
    assert q.bits == bits
    got = np.array(mx.dequantize(q.wq, q.scales, q.biases, group_size=GROUP, bits=q.bits))
    assert np.array_equal(got, w.dequantize().numpy())
    x = np.random.default_rng(1).standard_normal((3, w.shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ w.dequantize().numpy().astype(np.float64).T
    np.testing.assert_allclose(np.array(q.apply(mx.array(x))), ref, atol=1e-4, rtol=0)
    ids = mx.array([0, 5, 5, w.shape[0] - 1])
    assert np.array_equal(np.array(q.rows(ids)), got[[0, 5, 5, w.shape[0] - 1]])


def test_q6_k_stays_dense():
    from swaserve.mlx.quant import quantized

    assert quantized(weight_from("Q6_K", k_quant_blocks("Q6_K", 32, 512, 2), 32, 512)) is None


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_packing_is_mlxs(bits):
    """mx.quantize of groups that hold both 0 and the top value stores them with scale
    -1 and bias 2^bits - 1: its words are then the packing of the flipped values."""
    import mlx.core as mx

    from swaserve.mlx.quant import pack

    u = np.random.default_rng(bits).integers(0, 2**bits, (8, 128))
    u[:, ::32], u[:, 1::32] = 0, 2**bits - 1
    wq, scales, biases = mx.quantize(mx.array(u.astype(np.float32)), group_size=32, bits=bits)
    assert np.all(np.array(scales) == -1) and np.all(np.array(biases) == 2**bits - 1)
    assert np.array_equal(np.array(wq), pack(2**bits - 1 - u, bits))
