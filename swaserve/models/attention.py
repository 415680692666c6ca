"""Attention over the paged full pool and the per-request window rings.

`AttentionBackend` is the seam; `SDPABackend` (torch scaled_dot_product_attention) is the
default and runs on CPU and CUDA alike. Each layer first writes its new K/V into its pool,
then attends group by group as the ForwardContext describes. A layer that reuses another's
KV (CacheLayout: `kv_source`) is handed that layer's K/V of the step and writes nothing: it
reads the source's buffers at the same slots. In bf16 on the CPU two C
kernels take over (kernels/attention.py): one query per sequence (the decode rows) reads the
keys where the cache holds them; a sequence's prompt chunk (on AVX-512 BF16)
runs its tiles of queries over the key blocks its mask leaves.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from swaserve.kernels.attention import (
    decode_attention_bf16,
    decode_attention_q8,
    prefill_attention_bf16,
    prefill_attention_q8,
    prefill_preferred,
)
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.kv_quant import KVBuffers, StoredKV
from swaserve.memory.layout import LayerKind
from swaserve.models.context import ForwardContext, KeyView
from swaserve.profile import timed


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ctx: ForwardContext, scale: float, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the batch's new tokens -> output [T, H * D].
        `sinks` [H]: a learned logit per head that joins each softmax's denominator."""
        ...


class SDPABackend:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.layout = cache.layout
        self._dense = [self.layout.dense_index(i) for i in range(len(self.layout.layers))]

    @timed("attention")
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ctx: ForwardContext, scale: float, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
        kind = self.layout.layers[layer].kind
        dense = self._dense[layer]
        pool, k, v = self._store(layer, k, v, ctx)
        num_heads, head_dim = q.shape[1], q.shape[2]
        gqa = num_heads != k.shape[1]
        outs = []
        for g in ctx.groups:
            view = g.full if kind is LayerKind.FULL else g.sliding
            if g.num_queries == 1 and not view.fresh:
                o = decode_attention(q[g.start:g.end], pool, dense, view.key_slots,
                                     view.mask, scale, sinks)
                if o is not None:
                    outs.append(o)
                    continue
            if g.batch == 1 and g.num_queries > 1:
                o = _prompt_attention(q[g.start:g.end], k[g.start:g.end], v[g.start:g.end],
                                      pool, dense, view, scale, sinks)
                if o is not None:
                    outs.append(o)
                    continue
            qg = q[g.start:g.end].view(g.batch, g.num_queries, num_heads, head_dim).transpose(1, 2)
            if view.fresh:
                kg = k[g.start:g.end].view(g.batch, g.num_queries, -1, head_dim).transpose(1, 2)
                vg = v[g.start:g.end].view(g.batch, g.num_queries, -1, head_dim).transpose(1, 2)
            elif view.ring_rows is not None:  # whole ring blocks: copy rows, not elements
                ring = self.cache.window.ring
                width = view.key_slots.shape[-1]
                # consecutive rows: a strided view, no copy
                rows = (slice(view.first_row, view.first_row + g.batch)
                        if view.first_row is not None else view.ring_rows)
                kg, vg = pool.read(dense, partial(_ring_blocks, ring=ring, width=width, rows=rows),
                                   q.dtype)
                kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
            else:
                kg, vg = pool.read(dense, partial(_gather, slots=view.key_slots), q.dtype)
                kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
            window = self.layout.layers[layer].window
            with _invariant_kernel(ctx, q):
                # fresh keys under a mask: the runner's one-shot chunk past the window
                if view.fresh and view.mask is not None and window is not None:
                    o = _banded(qg, kg, vg, view, window, sinks, scale, gqa)
                else:
                    o = attend(qg, kg, vg, view, sinks, scale, gqa)
            outs.append(o.transpose(1, 2).reshape(g.batch * g.num_queries, num_heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
               ) -> tuple[KVBuffers, torch.Tensor, torch.Tensor]:
        """Write the step's K/V into the layer's pool (and the window pages that a prefix
        cache keeps); the pool and the K/V as attention reads them (a quantized pool's
        values dequantized)."""
        spec = self.layout.layers[layer]
        dense = self._dense[layer]
        if spec.kind is LayerKind.FULL:
            pool, writes = self.cache.full, ctx.view("full")
        else:
            pool, writes = self.cache.window, ctx.view("window")
        k_store, v_store = k, v
        if pool.kv_format.quantized:  # the step's own K/V read back as the pool gives them
            kv = StoredKV.of(torch.stack((k, v)), pool.kv_format)  # one call: half the ops
            k_store, v_store = kv[0], kv[1]
            k, v = kv.dequantize(k.dtype).unbind(0)
        if spec.stores_kv:  # a reusing layer's k, v are its source's, written already
            pool.write(dense, writes.slots, k_store, v_store)
        if spec.kind is LayerKind.SLIDING and spec.stores_kv and writes.pages is not None:
            idx, wslots = writes.pages
            self.cache.window_pages.write(dense, wslots, k_store[idx], v_store[idx])
        return pool, k, v

def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return buf[slots]


def _ring_blocks(buf: torch.Tensor, ring: int, width: int,
                 rows: slice | torch.Tensor) -> torch.Tensor:
    """The first `width` slots of the rings of `rows` (a slice: a view; else a copy)."""
    blocks = buf.view(-1, ring, *buf.shape[1:])
    if isinstance(rows, slice):
        return blocks[rows, :width]
    return blocks[:, :width].index_select(0, rows)


def decode_attention(q: torch.Tensor, pool: KVBuffers, dense: int, slots: torch.Tensor,
                     mask: torch.Tensor | None, scale: float,
                     sinks: torch.Tensor | None) -> torch.Tensor | None:
    """One query per sequence through the C decode kernel over the pool's buffers as they
    are stored; None where no kernel takes them (SDPA then runs)."""
    if not pool.kv_format.quantized:
        return decode_attention_bf16(q, pool.k[dense], pool.v[dense], slots, mask, scale, sinks)
    if pool.kv_format.values == torch.int8:
        return decode_attention_q8(q, pool.k[dense], pool.v[dense], pool.k_scale[dense],
                                   pool.v_scale[dense], slots, mask, scale, sinks)
    return None  # fp8: no kernel, SDPA on the dequantized keys


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view, sinks: torch.Tensor | None,
            scale: float, gqa: bool) -> torch.Tensor:
    """q [B, H, Nq, D] over k, v [B, KVH, L, D] as `view` masks them."""
    if sinks is not None:
        return _attend_with_sinks(q, k, v, view, sinks, scale, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=view.mask,
                                          is_causal=view.causal and view.mask is None,
                                          scale=scale, enable_gqa=gqa)


BAND_QUERIES = 256  # queries a block of a banded prompt chunk


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view, window: int,
            sinks: torch.Tensor | None, scale: float, gqa: bool) -> torch.Tensor:
    """A fresh chunk longer than a sliding layer's window: its banded mask leaves each
    query the `window` keys up to it, so a block of queries attends only the keys from
    its first query's window on. SDPA over the whole mask would compute every key of the
    chunk for every query (at 2,048 tokens and a window of 512, 8x the attended pairs)
    and give masked-out keys nothing but time."""
    n = q.shape[2]
    if n <= BAND_QUERIES + window:
        return attend(q, k, v, view, sinks, scale, gqa)
    outs = []
    for i0 in range(0, n, BAND_QUERIES):
        i1 = min(n, i0 + BAND_QUERIES)
        k0 = max(0, i0 - window + 1)
        block = KeyView(fresh=True, causal=False, key_slots=None,
                        mask=view.mask[..., i0:i1, k0:i1])
        outs.append(attend(q[:, :, i0:i1], k[:, :, k0:i1], v[:, :, k0:i1], block, sinks,
                            scale, gqa))
    return torch.cat(outs, dim=2)


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVBuffers,
                      dense: int, view, scale: float,
                      sinks: torch.Tensor | None) -> torch.Tensor | None:
    """One sequence's prompt chunk through the C kernel (bf16, AVX-512 BF16, no AMX): its
    own new keys (fresh) or those at its key slots, under its mask; None where it does not
    run (kernels/attention.py `prefill_preferred`)."""
    if (q.dtype != torch.bfloat16 or q.device.type != "cpu" or q.shape[-1] % 16
            or not prefill_preferred()):
        return None  # before the gather below: SDPA would gather the keys again
    int8 = not view.fresh and pool.kv_format.values == torch.int8
    if not view.fresh and not int8:
        k, v = pool.read(dense, partial(_gather, slots=view.key_slots[0]), q.dtype)
    mask = view.mask
    if mask is None and not view.causal:
        keys = view.key_slots.shape[-1] if int8 else k.shape[0]
        mask = torch.ones(q.shape[0], keys, dtype=torch.bool)
    if int8:  # the int8 keys where the cache holds them, dequantized as they are packed
        return prefill_attention_q8(q, pool.k[dense], pool.v[dense], pool.k_scale[dense],
                                    pool.v_scale[dense], view.key_slots[0], mask, scale, sinks)
    return prefill_attention_bf16(q, k, v, mask, scale, sinks)


def _invariant_kernel(ctx: ForwardContext, q: torch.Tensor):
    """In batch-invariant mode, float32 attention on the CPU takes SDPA's math kernel:
    torch's float32 flash kernel gives a (sequence, head) different bits depending on which
    thread computes it (on AMD Zen 5 with 2 threads, heads of a batch differ from the same
    rows run one by one), so a row's bits would follow its place in the batch. The
    math kernel's bits do not; bf16 takes flash, whose bits do not either."""
    if ctx.row_block is None or q.dtype != torch.float32 or q.device.type != "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view, sinks: torch.Tensor,
                       scale: float, gqa: bool) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink[h]): one extra key of zeros
    (score 0) whose additive mask entry is the sink logit, and a zero value, so the sink
    takes probability mass without adding to the output."""
    b, h, nq, _ = q.shape
    kvh, nk = k.shape[1], k.shape[2]
    if view.mask is not None:
        allowed = view.mask.expand(b, 1, nq, nk)
    elif view.causal:
        allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)[None, None]
        allowed = allowed.expand(b, 1, nq, nk)
    else:
        allowed = torch.ones(b, 1, nq, nk, dtype=torch.bool, device=q.device)
    bias = torch.zeros(b, h, nq, nk + 1, dtype=q.dtype, device=q.device)
    bias[..., :nk].masked_fill_(~allowed, float("-inf"))
    bias[..., nk] = sinks.to(q.dtype)[None, :, None]
    zeros = torch.zeros(b, kvh, 1, k.shape[3], dtype=k.dtype, device=k.device)
    return F.scaled_dot_product_attention(q, torch.cat([k, zeros], 2), torch.cat([v, zeros], 2),
                                          attn_mask=bias, scale=scale, enable_gqa=gqa)
