"""Small building blocks shared by model families."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from swaserve.kernels.gelu import gelu_tanh_mul_bf16
from swaserve.kernels.norm import add_rms_norm_bf16, rms_norm_bf16
from swaserve.kernels.q8_weight import Q8Weight
from swaserve.profile import timed


@timed("norms + activations")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32; `weight` is the full multiplier (Gemma's 1 + w is folded
    in at load time). bf16 rows on the CPU take one C call (kernels/norm.py; a Gemma layer
    has six norms, and torch spends ~8 ops on each); otherwise torch's rms_norm."""
    y = rms_norm_bf16(x, weight, eps)
    if y is not None:
        return y
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


@timed("norms + activations")
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w_delta: torch.Tensor | None,
                 w_next: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual add and the norm after it: x' = x + rms_norm(delta, w_delta) (x + delta
    without w_delta, as in Llama), and rms_norm(x', w_next) if w_next is given. bf16 rows on
    the CPU take one C call (kernels/norm.py) with the same bits."""
    fused = add_rms_norm_bf16(x, delta, w_delta, w_next, eps)
    if fused is not None:
        return fused
    x = x + (delta if w_delta is None else rms_norm(delta, w_delta, eps))
    return x, None if w_next is None else rms_norm(x, w_next, eps)


@timed("norms + activations")
def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] along the last dim (the GeGLU MLP):
    bf16 rows on the CPU take one C call (kernels/gelu.py), others torch's two ops."""
    y = gelu_tanh_mul_bf16(gate_up)
    if y is not None:
        return y
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scale for a RoPE variant: default,
    linear, llama3 (smoothed per-band scaling), yarn (NTK-by-parts with a ramp),
    freq_factors (each frequency divided by its factor: a Llama 3 GGUF's rope_freqs) or
    proportional (only `partial_rotary_factor` of the frequencies, at the whole head's
    exponents; the others 0, so those dims pass unrotated)."""
    dim = head_dim
    # explicit CPU tensors: models are built under the meta device
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv, 1.0
    if kind == "proportional":  # Gemma 4: the first part of each half rotates, the rest not
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv[angles:] = 0.0
        return inv / float(scaling.get("factor", 1.0)), 1.0
    if kind == "freq_factors":
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu"), 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old = float(scaling["original_max_position_embeddings"])
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

        def corr_dim(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr_dim(fast), corr_dim(slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp
        return (inv / factor) * (1 - extrapolate) + inv * extrapolate, float(attn)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, "
                     "freq_factors, proportional)")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for absolute positions (rotate-half layout), in `dtype`."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@timed("projections")
def linear(x: torch.Tensor, w: torch.Tensor, row_block: int | None = None,
           q8: Q8Weight | None = None, kernel: str | None = None) -> torch.Tensor:
    """x @ w.T; a single row goes through matrix-vector, which CPU BLAS runs faster than a
    one-row matmul (the batch-1 decode path). With `row_block` (batch-invariant
    mode), rows are multiplied in blocks of exactly that many (see `rows_in_blocks`).
    `q8`, the same weight as exact int8 blocks, takes the batches its kernel (`kernel`, or
    the fastest for the rows) runs faster (half the bytes to read)."""
    if q8 is not None and q8.takes(x, kernel):
        y = q8.matmul(x, dtype=x.dtype, kernel=kernel)
        if y is not None:
            return y
    if row_block is not None:
        return rows_in_blocks(lambda part: torch.nn.functional.linear(part, w), x, row_block)
    if x.dim() == 2 and x.shape[0] == 1:
        return torch.mv(w, x[0])[None]
    return torch.nn.functional.linear(x, w)


def rows_in_blocks(fn, x: torch.Tensor, row_block: int) -> torch.Tensor:
    """fn (row by row, such as a matmul) over blocks of exactly `row_block` rows of x, the
    last one padded with zero rows, concatenated: batch-invariant matmuls. CPU GEMM
    kernels pick their blocking by the number of rows, so a row's result would otherwise
    depend on how many other rows share its step: one row goes to matrix-vector (3 rows in
    2,000 round differently at [128, 32] in bf16); Intel's oneDNN gives every count up to
    32 the same bits but not 33 and more; on AMD Zen 5 float32 rounds the last M % 4 rows
    of a block of under 12 differently. One block size for every call leaves the BLAS one
    choice, and a row's bits do not depend on its place within the block."""
    m = x.shape[0]
    pad = -m % row_block
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    if x.shape[0] == row_block:
        return fn(x)[:m]
    return torch.cat([fn(part) for part in x.split(row_block)])[:m]
