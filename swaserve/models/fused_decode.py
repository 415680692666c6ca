"""The fused decode step for Gemma-3-shaped layers (kernels/decode.c runs their forward,
kernel for kernel, in one C call): this side reads a model's layers, its attention
backend's cache and a step's ForwardContext, and fills the structs the kernel takes.

`FusedDecode.run` returns None for any step it does not take — not a pure decode step,
a kernel missing, weights without int8 tiles, batch-invariant row blocks, an fp8 cache — and
the model then runs its layers one by one (tests/models/test_fused_decode.py: the same bits
either way; with an int8 cache too, tests/models/test_kv_quant_contracts.py).
"""

from __future__ import annotations

import torch

from swaserve import profile
from swaserve.kernels import decode
from swaserve.memory.layout import LayerKind


def _cache_ptrs(pool, pages, dense: int, q8_attention: bool
                ) -> tuple[dict[str, int], list[torch.Tensor]] | None:
    """A layer's LayerPtrs fields for its pool's buffers (and its window pages', or None):
    bf16, or int8 with their scales where attention_q8.c is built; None for any other
    (fp8: no kernel reads it in place). With them, the tensors they point into."""
    bufs = {"k_pool": pool.k[dense], "v_pool": pool.v[dense]}
    int8 = bufs["k_pool"].dtype == torch.int8
    if bufs["k_pool"].dtype != torch.bfloat16 and not (int8 and q8_attention):
        return None
    if int8:
        bufs.update(k_scale=pool.k_scale[dense], v_scale=pool.v_scale[dense])
    if pages is not None:
        bufs.update(kw_pool=pages.k[dense], vw_pool=pages.v[dense])
        if int8:
            bufs.update(kw_scale=pages.k_scale[dense], vw_scale=pages.v_scale[dense])
    if not all(t.is_contiguous() for t in bufs.values()):
        return None
    ptrs = {name: t.data_ptr() for name, t in bufs.items()}
    if int8:
        ptrs["kv_blocks"] = bufs["k_scale"].shape[2]
    return ptrs, list(bufs.values())


class FusedDecode:
    """Built once for a model's layers and its attention backend's cache."""

    def __init__(self, layers, backend):
        first = layers[0]
        self.heads, self.kv_heads, self.head_dim = (first.num_heads, first.num_kv_heads,
                                                    first.head_dim)
        self.hidden = first.o.shape[0]
        self.eps = first.eps
        self.num_layers = len(layers)
        self.ok = self._build(layers, backend)
        self.steps = 0  # steps run here
        self._bufs: dict[int, tuple[list[torch.Tensor], decode.Bufs]] = {}

    def _build(self, layers, backend) -> bool:
        names = ("qkv", "o", "gate_up", "down")
        if any(not all(n in layer.q8 and layer.q8[n].tiled for n in names) for layer in layers):
            return False
        fns = decode.entry_points("amx")
        if fns is None or not decode.heads_fit(self.heads, self.kv_heads, self.head_dim):
            return False
        q8_attention = bool(fns.attn_q8)
        self._keep = []  # tensors whose addresses the structs hold
        self._weight = layers[0].q8["qkv"]
        # per tile kernel: q8_vnni reads the packed values where a weight has them
        arrs = {kernel: (decode.LayerPtrs * len(layers))() for kernel in decode.TILE_KERNELS}
        for i, layer in enumerate(layers):
            kind = backend.layout.layers[i].kind
            full = kind is LayerKind.FULL
            pool = backend.cache.full if full else backend.cache.window
            dense = backend.layout.dense_index(i)
            pages = backend.cache.window_pages if not full else None
            cache = _cache_ptrs(pool, pages, dense, q8_attention)
            if cache is None:
                return False
            weights = {kernel: {} for kernel in arrs}
            for n in names:
                w = layer.q8[n]
                for kernel, ws in weights.items():
                    q, flags = w.tiles_for(kernel)
                    ws[n] = decode.Q8W(q.data_ptr(), w.scales.data_ptr(),
                                       0 if w.offsets is None else w.offsets.data_ptr(),
                                       flags, w.shape[0], w.shape[1])
            norms = {}
            for n in ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm",
                      "post_ffn_norm"):
                p = getattr(layer, n, None)
                if p is None or p.dtype != torch.float32 or not p.is_contiguous():
                    return False
                norms[n] = p.data_ptr()
            ptrs, keep = cache
            for kernel, arr in arrs.items():
                arr[i] = decode.LayerPtrs(**weights[kernel], **norms, **ptrs, kind=int(full))
            self._keep += keep
        self._layers = arrs
        return True

    def _buffers(self, m: int) -> decode.Bufs:
        if m not in self._bufs:
            qs, kvs = self.heads * self.head_dim, self.kv_heads * self.head_dim
            inter = self._layers["amx"][0].gate_up.n // 2
            widths = {"h": self.hidden, "qkv": qs + 2 * kvs, "q": qs, "k": kvs, "attn": qs,
                      "o": self.hidden, "gu": 2 * inter, "act": inter, "down": self.hidden}
            ts = [torch.empty(m, widths[n], dtype=torch.bfloat16) for n in decode.BUFS]
            self._bufs[m] = (ts, decode.Bufs(*(t.data_ptr() for t in ts)))
        return self._bufs[m][1]

    def run(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
            ctx, scale: float) -> torch.Tensor | None:
        """x [m, hidden] bf16 after the embedding (updated in place) -> x after the last
        layer; None when this step is not one it takes (nothing was written then)."""
        if not self.ok or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return None
        if ctx.row_block is not None or len(ctx.groups) != 1:
            return None
        g = ctx.groups[0]
        m = x.shape[0]
        if not g.decode or g.batch != m or not x.is_contiguous():
            return None
        kernel = self._weight.kernel_for(m, ctx.q8_kernel)  # every layer's weights alike
        fns = decode.entry_points(kernel) if kernel in decode.TILE_KERNELS else None
        if fns is None:
            return None
        kinds = (decode.KindPtrs * 2)()
        keep = []  # the tensors whose addresses `kinds` holds, alive through the call
        page_rows = page_slots = None
        window, full = ctx.view("window"), ctx.view("full")
        if window is not None and window.pages is not None:
            page_rows, page_slots = (t.contiguous() for t in window.pages)
            keep += [page_rows, page_slots]
        for kind, (view, writes, sliding) in enumerate(((g.sliding, window, True),
                                                       (g.full, full, False))):
            if view is None:
                continue
            write = writes.slots
            if view.fresh or view.key_slots is None or view.key_slots.dtype != torch.int64:
                return None
            cos, sin = rope[sliding]
            if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.bfloat16
                    and cos.shape == (m, self.head_dim) and sin.shape == cos.shape):
                return None
            slots = view.key_slots.contiguous()
            keys = slots.shape[1]
            mask = None
            if view.mask is not None:
                mask = view.mask.reshape(m, keys).contiguous().view(torch.uint8)
            write = write.contiguous()
            keep += [slots, mask, write]
            pages = sliding and page_rows is not None
            kinds[kind] = decode.KindPtrs(write.data_ptr(), slots.data_ptr(),
                                0 if mask is None else mask.data_ptr(), keys,
                                cos.data_ptr(), sin.data_ptr(),
                                page_rows.data_ptr() if pages else 0,
                                page_slots.data_ptr() if pages else 0,
                                page_rows.numel() if pages else 0)
        prof = profile.active()
        parts = decode.decode_layers(fns, self._layers[kernel], self.num_layers, kinds, x,
                                     self._buffers(m), self.hidden, self.heads, self.kv_heads,
                                     self.head_dim, self.eps, scale, timed=prof is not None)
        for name, seconds in (parts or {}).items():  # what is left is the cache writes
            prof.credit(name, seconds)
        self.steps += 1
        return x
