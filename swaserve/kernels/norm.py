"""RMSNorm of bf16 rows, and the residual adds and rotations around it, in one C call each
(`norm.c`): the float32 math and bf16 roundings of `model.layers`' torch path, without its
~8 ops a norm and ~6 a rotation. Each function returns None when the kernel is absent or
the inputs are not a layout it takes; callers then run torch."""

from __future__ import annotations

import torch

from swaserve.kernels import build

MAX_DIM = build.constants()["NORM_MAX_DIM"]  # the C kernel's row buffers


def norm_entry():
    return build.function("norm", "rms_norm_bf16")


def add_norm_entry():
    return build.function("norm", "add_rms_norm_bf16")


def rope_entry():
    return build.function("norm", "qk_norm_rope_bf16")


def _takes(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1
            and x.shape[-1] <= MAX_DIM and all(
                w is None or (w.dtype == torch.float32 and w.is_contiguous()) for w in weights))


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] bf16 on the CPU (last dim contiguous, at most 3 dims), weight float32 [D]."""
    if not _takes(x, weight) or x.dim() not in (2, 3):
        return None
    fn = norm_entry()
    if fn is None:
        return None
    d = x.shape[-1]
    outer, inner = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    s_outer, s_inner = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), outer, inner, s_outer, s_inner, d, eps,
       torch.get_num_threads())
    return y


def add_rms_norm_bf16(x: torch.Tensor, delta: torch.Tensor, w_delta: torch.Tensor | None,
                      w_next: torch.Tensor | None, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """x' = x + rms_norm(delta, w_delta) (plain x + delta without w_delta), and
    rms_norm(x', w_next) when w_next is given. x [T, D] contiguous, delta [T, D] rows."""
    if (not _takes(delta, w_delta, w_next) or x.dtype != torch.bfloat16 or x.dim() != 2
            or not x.is_contiguous() or delta.shape != x.shape):
        return None
    fn = add_norm_entry()
    if fn is None:
        return None
    x_out = torch.empty_like(x)
    h = torch.empty_like(x) if w_next is not None else None
    fn(x.data_ptr(), delta.data_ptr(), delta.stride(0),
       None if w_delta is None else w_delta.data_ptr(),
       None if w_next is None else w_next.data_ptr(), x_out.data_ptr(),
       None if h is None else h.data_ptr(), x.shape[0], x.shape[1], eps,
       torch.get_num_threads())
    return x_out, h


def qk_norm_rope_bf16(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """From qkv [T, (H + 2 KVH) * D]: q [T, H, D] and k [T, KVH, D], each head RMS-normed
    when its weight is given, then rotated by cos/sin [T, D] (rotate-half RoPE)."""
    t = qkv.shape[0]
    if (not _takes(qkv, q_norm, k_norm) or qkv.dim() != 2 or head_dim % 2
            or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16
            or cos.shape != (t, head_dim) or sin.shape != cos.shape
            or cos.stride() != sin.stride() or cos.stride(-1) != 1):
        return None
    fn = rope_entry()
    if fn is None:
        return None
    q = torch.empty(t, heads, head_dim, dtype=torch.bfloat16)
    k = torch.empty(t, kv_heads, head_dim, dtype=torch.bfloat16)
    fn(qkv.data_ptr(), qkv.stride(0), None if q_norm is None else q_norm.data_ptr(),
       None if k_norm is None else k_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
       cos.stride(0), q.data_ptr(), k.data_ptr(), t, heads, kv_heads, head_dim, eps,
       torch.get_num_threads())
    return q, k
