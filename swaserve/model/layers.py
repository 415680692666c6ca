"""Small building blocks shared by model families."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32; `weight` is the full multiplier (Gemma's 1 + w is folded
    in at load time)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for absolute positions (rotate-half layout), in `dtype`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                            device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T; a single row goes through matrix-vector, which CPU BLAS runs ~1.5x faster
    than a one-row matmul (the batch-1 decode path)."""
    if x.dim() == 2 and x.shape[0] == 1:
        return torch.mv(w, x[0])[None]
    return torch.nn.functional.linear(x, w)
