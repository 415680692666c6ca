"""A decode step's decoder layers in one C call (`decode.c`) for Gemma-3-shaped layers:
the same kernels as the Python layers, in the same order, so the same bits, without the
Python and torch between them. A leaf: the structs decode.c reads (weights, norms and
cache buffers by address, bf16 or int8 with their scales; per attention kind the step's
slots, masks and RoPE rows), the entry points it calls, and the call.
models/fused_decode.py fills them from a model.
"""

from __future__ import annotations

import ctypes

import torch

from swaserve.kernels import attention, build, gelu, norm, q8

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Fns(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("q8", "norm", "add_norm", "rope", "attn", "gelu",
                                        "attn_q8")]


class Q8W(ctypes.Structure):
    _fields_ = [("pq", _P), ("ps", _P), ("po", _P), ("flags", _I), ("n", _I), ("k", _I)]


class LayerPtrs(ctypes.Structure):
    _fields_ = ([(name, Q8W) for name in ("qkv", "o", "gate_up", "down")]
                + [(name, _P) for name in ("attn_norm", "q_norm", "k_norm", "post_attn_norm",
                                           "ffn_norm", "post_ffn_norm", "k_pool", "v_pool",
                                           "kw_pool", "vw_pool", "k_scale", "v_scale",
                                           "kw_scale", "vw_scale")]
                + [("kv_blocks", _I), ("kind", _I)])


class KindPtrs(ctypes.Structure):
    _fields_ = [("write_slots", _P), ("key_slots", _P), ("mask", _P), ("keys", _I),
                ("cos", _P), ("sin", _P), ("page_rows", _P), ("page_slots", _P),
                ("num_page_writes", _I)]


BUFS = ("h", "qkv", "q", "k", "attn", "o", "gu", "act", "down")  # scratch, [m, width] bf16


class Bufs(ctypes.Structure):
    _fields_ = [(name, _P) for name in BUFS]


def address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _entry():
    return build.function("decode", "decode_layers")


TILE_KERNELS = q8.TILE_ENTRIES


def entry_points(tile_kernel: str) -> Fns | None:
    """The kernels decode.c calls, with `tile_kernel` (a key of TILE_KERNELS) for the matmuls;
    None when one of them (or decode.c itself) cannot be built here. `attn_q8` (int8
    caches) is 0 where attention_q8.c cannot be built."""
    fns = [TILE_KERNELS[tile_kernel](), norm.norm_entry(), norm.add_norm_entry(),
           norm.rope_entry(), attention.entry(), gelu.entry()]
    if _entry() is None or any(fn is None for fn in fns):
        return None
    return Fns(*(address(fn) for fn in fns), address(attention.q8_entry()) or 0)


def heads_fit(heads: int, kv_heads: int, head_dim: int) -> bool:
    """The attention kernel's per-head buffers hold these shapes."""
    return (heads % kv_heads == 0 and heads // kv_heads <= attention.MAX_GROUP
            and head_dim <= attention.MAX_DIM and head_dim % 2 == 0)


# what decode.c's timers count (kernels.h: DECODE_PRODUCTS, DECODE_ATTENTION, DECODE_NORMS),
# named as the step profiler names those parts of the layer-by-layer path
PARTS = {build.constants()[f"DECODE_{k}"]: name for k, name in (
    ("PRODUCTS", "projections"), ("ATTENTION", "attention"), ("NORMS", "norms + activations"))}


def decode_layers(fns: Fns, layers, num_layers: int, kinds, x: torch.Tensor, bufs: Bufs,
                  hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                  scale: float, timed: bool = False) -> dict[str, float] | None:
    """Run `num_layers` layers on x [m, hidden] bf16, in place; with `timed`, the
    seconds of each of PARTS' kernels (the rest of the call is the cache writes)."""
    seconds = (ctypes.c_double * len(PARTS))() if timed else None
    rc = _entry()(ctypes.byref(fns), layers, num_layers, kinds, x.data_ptr(), ctypes.byref(bufs),
                  x.shape[0], hidden, heads, kv_heads, head_dim, eps, scale,
                  torch.get_num_threads(), seconds)
    if rc != 0:
        raise RuntimeError(f"decode_layers failed in a kernel (code {rc})")
    return None if seconds is None else {PARTS[i]: seconds[i] for i in PARTS}
