"""int8 weights with a float scale per 32 (GGUF Q8_0): exact, and half the bytes of bf16.

At batch 1 a decode step is bound by the bytes of weights it reads; the 640 x 262,144 LM
head of the bundled model is Q8_0 in its GGUF, so it is kept as int8 + scales beside its
bf16 copy (which larger batches multiply on AMX) and small batches go through
`q8_matvec.c` (built by kernels/build.py; without a compiler the bf16 path is used).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from swaserve.kernels import build

BLOCK = 32
MAX_ROWS = 8  # rows of activations one call takes (q8_matvec.c)
FAST_ROWS = 4  # up to this many rows the kernel beats bf16 AMX (benchmarks/README.md)


def _load():
    """The kernel's entry point, or None when it cannot be built here."""
    return build.function("q8_matvec", "q8_matvec", ctypes.c_int,
                          [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int])


def available() -> bool:
    return _load() is not None


class Q8Weight:
    """An [N, K] weight as int8 values and float32 scales per block of 32 along K."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % BLOCK:
            raise ValueError(f"Q8Weight: int8 [N, K] with K % {BLOCK} == 0, got {q.dtype} "
                             f"{tuple(q.shape)}")
        self.q = q.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        if self.scales.shape != (q.shape[0], q.shape[1] // BLOCK):
            raise ValueError(f"Q8Weight: scales {tuple(scales.shape)} do not match {tuple(q.shape)}")

    @classmethod
    def from_q8_0_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        """From GGUF Q8_0 data: per block of 32, a float16 scale then 32 int8 values."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 2 + BLOCK)
        d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
        return cls(torch.from_numpy(q), torch.from_numpy(d))

    @classmethod
    def from_q5_0_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        """From GGUF Q5_0 data: per block of 32, a float16 scale, 32 high bits (uint32), then
        16 bytes of low nibbles (values j and j + 16 share byte j); value = 5 bits - 16."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 22)
        d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        qh = blocks[:, :, 2:6].copy().view(np.uint32)[:, :, 0]
        qs = blocks[:, :, 6:22].astype(np.int16)
        bits = (qh[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        q = (low | (bits.astype(np.int16) << 4)) - 16
        return cls(torch.from_numpy(q.astype(np.int8).reshape(n, k)), torch.from_numpy(d))

    @classmethod
    def stack(cls, parts: list[Q8Weight]) -> Q8Weight:
        """Rows of several weights one after the other (q, k, v -> qkv)."""
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, k // BLOCK, BLOCK).float() * self.scales[:, :, None]).view(n, k)

    def matvec(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] (M <= MAX_ROWS, CPU) @ W.T in float32; None when the kernel is absent."""
        fn = _load()
        if fn is None or x.shape[0] > MAX_ROWS or x.device.type != "cpu":
            return None
        xf = x.to(torch.float32).contiguous()
        m, k = xf.shape
        n = self.q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        rc = fn(xf.data_ptr(), self.q.data_ptr(), self.scales.data_ptr(), y.data_ptr(),
                m, n, k, torch.get_num_threads())
        return y if rc == 0 else None
