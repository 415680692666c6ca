"""RMSNorm of bf16 rows in one C call (`rms_norm.c`): the same float32 math as
`model.layers.rms_norm`'s torch path, without its ~8 ops a call."""

from __future__ import annotations

import ctypes

import torch

from swaserve.kernels import build

MAX_DIM = 8192  # the C kernel's row buffer


def _load():
    return build.function("rms_norm", "rms_norm_bf16", None,
                          [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float])


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] bf16 on the CPU (last dim contiguous, at most 3 dims), weight float32 [D];
    None when the kernel is absent or the layout is not one it takes."""
    if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() not in (2, 3)
            or x.stride(-1) != 1 or x.shape[-1] > MAX_DIM or weight.dtype != torch.float32
            or not weight.is_contiguous()):
        return None
    fn = _load()
    if fn is None:
        return None
    d = x.shape[-1]
    outer, inner = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    s_outer, s_inner = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), outer, inner, s_outer, s_inner, d, eps)
    return y
