"""Gemma's MLP activation, gelu_tanh(gate) * up, on bf16 rows in one C call (`gelu.c`):
torch's GELU and multiply read and write three bf16 tensors, a large part of a prefill
chunk's elementwise work."""

from __future__ import annotations

import torch

from swaserve.kernels import build


def entry():
    return build.function("gelu", "gelu_tanh_mul_bf16")


def gelu_tanh_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2 I] bf16 on the CPU (gate then up along the last dim, rows contiguous)
    -> [T, I]; None when the kernel is absent or the layout is not one it takes."""
    if (gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or gate_up.dim() != 2
            or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2):
        return None
    fn = entry()
    if fn is None:
        return None
    rows, d = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, d, dtype=torch.bfloat16)
    fn(gate_up.data_ptr(), y.data_ptr(), rows, d, gate_up.stride(0), torch.get_num_threads())
    return y
