"""GGUF weights in MLX's affine quantized format, where the formats map exactly.

MLX stores w = scale * u + bias per group along K, u an unsigned `bits`-bit value packed
little-endian into uint32 words. The GGUF blocks read as int8 (kernels/q8_weight.py: w = q *
scale - offset) map onto it with the file's values:
- Q8_0 (q in [-128, 127], one scale per 32): bits 8, u = q + 128, bias = -128 * scale;
- Q5_0 (q in [-16, 15]): bits 5, u = q + 16, bias = -16 * scale;
- Q4_K (q in [0, 15], a scale and a minimum per 32): bits 4, u = q, bias = -minimum;
- a stack of them (q/k/v with Q5_0 and Q8_0 parts): the bits the widest part needs.
Scales and biases stay float32, where every one of these is exact (a Q4_K scale is a
float16 times a 6-bit integer); the dequantized value u * scale + bias is then the
file's, as gguf dequantizes it. Q6_K keeps a scale per 16 values, a group MLX has no
kernel for: those weights stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swaserve.kernels.q8_weight import Q8Weight
from swaserve.mlx import require

GROUP = 32
BITS = (4, 5, 6, 8)


@dataclass
class QuantizedLinear:
    """An [N, K] weight in MLX's format: `apply(x)` = x @ w.T in float32."""

    wq: object  # uint32 [N, K * bits / 32]
    scales: object  # float32 [N, K / 32]
    biases: object
    bits: int

    def apply(self, x):
        return require().quantized_matmul(x, self.wq, self.scales, self.biases, transpose=True,
                                          group_size=GROUP, bits=self.bits)

    def rows(self, ids):
        """Rows `ids` of w, dequantized (an embedding lookup of a tied LM head)."""
        mx = require()
        return mx.dequantize(self.wq[ids], self.scales[ids], self.biases[ids],
                             group_size=GROUP, bits=self.bits)


def pack(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values u [N, K] (< 2**bits) -> MLX's packing: a little-endian bit stream,
    value j at bits [j * bits, (j + 1) * bits), as uint32 words [N, K * bits / 32]."""
    n, k = u.shape
    if bits == 8:
        return np.ascontiguousarray(u.astype(np.uint8)).view(np.uint32)
    # 8 values fill `bits` bytes: assemble them in a uint64, keep its low `bits` bytes
    eight = u.astype(np.uint64).reshape(n, k // 8, 8) << (np.arange(8, dtype=np.uint64) * bits)
    words = np.bitwise_or.reduce(eight, axis=-1)
    return np.ascontiguousarray(words[..., None].view(np.uint8)[..., :bits]).reshape(n, -1).view(np.uint32)


def quantized(w: Q8Weight) -> QuantizedLinear | None:
    """`w` in MLX's format, or None where it does not map exactly (groups of 16)."""
    if w.group != GROUP or w.tiled:
        return None
    mx = require()
    q = w.q.numpy()
    lo, hi = int(q.min()), int(q.max())
    scales = w.scales.numpy()
    if w.offsets is None:  # signed values: shift them up by half the range
        bits = next((b for b in BITS if -(1 << (b - 1)) <= lo and hi < 1 << (b - 1)), None)
        shift = 1 << (bits - 1)
        u = q.astype(np.int16) + shift
        biases = -shift * scales
    else:
        bits = next((b for b in BITS if lo >= 0 and hi < 1 << b), None)
        if bits is None:
            return None
        u = q
        biases = -w.offsets.numpy()
    return QuantizedLinear(mx.array(pack(u, bits)), mx.array(scales), mx.array(biases), bits)
