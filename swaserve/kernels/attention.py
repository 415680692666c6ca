"""Decode attention of bf16 queries over the bf16 caches in one C call (`attention.c`), or
over int8 caches and their scales (`attention_q8.c`): the keys are read where the rings and
pages hold them, instead of gathered into a padded copy for SDPA."""

from __future__ import annotations

import functools

import torch

from swaserve.kernels import build

MAX_GROUP = build.constants()["ATTN_MAX_GROUP"]  # the C kernel's per-head buffers
MAX_DIM = build.constants()["ATTN_MAX_DIM"]


def entry():
    return build.function("attention", "decode_attention_bf16")


def q8_entry():
    return build.function("attention_q8", "decode_attention_q8")


def q8_int16(head_dim: int, blocks: int) -> bool:
    """`decode_attention_q8` takes heads of `head_dim` in `blocks` scales with its int16
    products (each query head and each softmax weight rounded to int16, attention_q8.c),
    not with float32 products."""
    fn = build.function("attention_q8", "decode_attention_q8_int16")
    return fn is not None and fn(head_dim, blocks) == 1


def _decode_takes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slots: torch.Tensor, values: torch.dtype) -> bool:
    """What both decode kernels need: bf16 queries [B, H, D] with contiguous heads on the
    CPU, pools [S, KVH, D] of `values`, alike and contiguous, heads that fit, int64 slots."""
    h, d = q.shape[1], q.shape[2]
    kvh = k_pool.shape[1]
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and k_pool.dtype == values
            and v_pool.dtype == values and h % kvh == 0 and h // kvh <= MAX_GROUP
            and d <= MAX_DIM and q.stride(2) == 1 and q.stride(1) == d
            and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.shape == v_pool.shape and k_pool.shape[2] == d
            and slots.dtype == torch.int64 and slots.dim() == 2)


def _decode_call(fn, q: torch.Tensor, buffers: tuple[torch.Tensor, ...], slots: torch.Tensor,
                 mask: torch.Tensor | None, sinks: torch.Tensor | None, dims: tuple[int, ...],
                 scale: float) -> torch.Tensor | None:
    """fn(q, q_stride, *buffers, slots, mask, sinks, out, B, H, *dims, scale, threads) ->
    out [B, H * D], None when it fails."""
    b, h, d = q.shape
    slots = slots.contiguous()
    if mask is not None:
        mask = mask.reshape(b, slots.shape[1]).contiguous().view(torch.uint8)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = torch.empty(b, h * d, dtype=torch.bfloat16)
    rc = fn(q.data_ptr(), q.stride(0), *(t.data_ptr() for t in buffers), slots.data_ptr(),
            None if mask is None else mask.data_ptr(),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(), b, h, *dims, scale,
            torch.get_num_threads())
    return out if rc == 0 else None


def decode_attention_bf16(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          slots: torch.Tensor, mask: torch.Tensor | None, scale: float,
                          sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [B, H, D] (one query per sequence), k_pool/v_pool [S, KVH, D], slots [B, L] int64
    cache slots, mask [B, L] bool (True = attend; None: all) -> [B, H * D]. bf16 on the CPU
    only; None when the kernel is absent or the inputs are not a layout it takes."""
    fn = entry()
    if fn is None or not _decode_takes(q, k_pool, v_pool, slots, torch.bfloat16):
        return None
    return _decode_call(fn, q, (k_pool, v_pool), slots, mask, sinks,
                        (k_pool.shape[1], q.shape[2], slots.shape[1]), scale)


def decode_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                        mask: torch.Tensor | None, scale: float,
                        sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """`decode_attention_bf16` over int8 pools [S, KVH, D] and their float32 scales [S, KVH,
    blocks] (memory/kv_quant.py): bf16 queries and output; None where the kernel does not
    run."""
    fn = q8_entry()
    if (fn is None or not _decode_takes(q, k_pool, v_pool, slots, torch.int8)
            or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32
            or k_scale.dim() != 3 or k_scale.shape[:2] != k_pool.shape[:2]
            or v_scale.shape != k_scale.shape or q.shape[2] % k_scale.shape[2]
            or not (k_scale.is_contiguous() and v_scale.is_contiguous())):
        return None
    return _decode_call(fn, q, (k_pool, v_pool, k_scale, v_scale), slots, mask, sinks,
                        (k_pool.shape[1], q.shape[2], k_scale.shape[2], slots.shape[1]), scale)


def prefill_entry():
    return build.function("attention", "prefill_attention_bf16")


@functools.cache
def prefill_available() -> bool:
    """The prompt kernel runs here: built, and with AVX-512 BF16 (checked once)."""
    one = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    return (prefill_entry() is not None
            and prefill_attention_bf16(one, one, one, None, 1.0) is not None)


@functools.cache
def prefill_preferred() -> bool:
    """The engine's bf16 prompt chunks take the kernel: it runs here, and the CPU has no
    AMX, where torch's SDPA (bf16 flash on AMX tiles) is faster; without AMX the kernel
    is several times faster than SDPA, whose bf16 flash is not built for AVX-512 BF16."""
    from swaserve.kernels.q8 import amx_available

    return prefill_available() and not amx_available()


def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, scale: float,
                           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """The queries of one sequence's prompt chunk over its keys: q [N, H, D], k and v
    [L, KVH, D], mask [N, L] bool (True = attend; None: causal, query i sees keys up to
    L - N + i), sinks [H] (a logit per head in each denominator) -> [N, H * D]. bf16 on
    a CPU with AVX-512 BF16 only; None where the kernel is absent or does not take the
    shapes (head dims that are not a multiple of 16)."""
    n, h, d = q.shape
    keys, kvh = k.shape[0], k.shape[1]
    if (q.dtype != torch.bfloat16 or q.device.type != "cpu" or k.dtype != q.dtype
            or v.dtype != q.dtype or k.shape != v.shape or k.shape[2] != d or h % kvh
            or (mask is None and keys < n)):
        return None
    fn = prefill_entry()
    if fn is None:
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if mask is not None:
        mask = mask.reshape(n, keys).contiguous().view(torch.uint8)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = torch.empty(n, h * d, dtype=torch.bfloat16)
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(), n, keys, h, kvh, d, scale,
            torch.get_num_threads())
    return out if rc == 0 else None


def prefill_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                         mask: torch.Tensor | None, scale: float,
                         sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """`prefill_attention_bf16` over the keys at `slots` [L] int64 of int8 pools [S, KVH, D]
    and their float32 scales [S, KVH, blocks], each key read as bf16(scale * int8): the bits of the
    kernel on torch's dequantized keys. None where the kernel does not run."""
    n, h, d = q.shape
    keys, kvh = slots.shape[0], k_pool.shape[1]
    if (q.dtype != torch.bfloat16 or q.device.type != "cpu" or k_pool.dtype != torch.int8
            or v_pool.dtype != torch.int8 or k_pool.shape != v_pool.shape
            or k_pool.shape[2] != d or h % kvh or k_scale.dtype != torch.float32
            or v_scale.dtype != torch.float32 or k_scale.dim() != 3
            or k_scale.shape[:2] != k_pool.shape[:2] or d % k_scale.shape[2]
            or v_scale.shape != k_scale.shape or slots.dtype != torch.int64 or slots.dim() != 1
            or not all(t.is_contiguous() for t in (k_pool, v_pool, k_scale, v_scale))
            or (mask is None and keys < n)):
        return None
    fn = build.function("attention", "prefill_attention_q8")
    if fn is None:
        return None
    q, slots = q.contiguous(), slots.contiguous()
    if mask is not None:
        mask = mask.reshape(n, keys).contiguous().view(torch.uint8)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = torch.empty(n, h * d, dtype=torch.bfloat16)
    rc = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_scale.data_ptr(),
            v_scale.data_ptr(), slots.data_ptr(), None if mask is None else mask.data_ptr(),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(), n, keys, h, kvh, d,
            k_scale.shape[2], scale, torch.get_num_threads())
    return out if rc == 0 else None
