"""`Q8Weight`: a GGUF weight as int8 values with a float scale (and offset) per group, the
file's weights bit for bit in about half the bytes of bf16, and its products on the q8
kernels (q8.py picks which).

A decode step is bound by the bytes of weights it reads, so a GGUF's quantized tensors
(Q8_0, Q5_0, Q4_K, Q6_K) are kept as int8 + scales (+ offsets for Q4_K) beside their bf16
copies, which prefill chunks multiply. Two layouts:

- rows [N, K], for `q8_matvec` (float32 FMAs, Q8_0 and Q5_0 only): the fallback on CPUs
  without AMX or AVX-512 VNNI;
- tiles (`to_tiles`): each block of 16 outputs x 32 inputs in the pair-interleaved order of
  an AMX tile, which every tile kernel reads. Tiles of Q5_0 and Q4_K values are also kept
  packed in 5 and 4 bits (`_pack`) for q8_vnni, whose few rows wait on the bytes they read.
"""

from __future__ import annotations

import numpy as np
import torch

from swaserve.kernels import build
from swaserve.kernels.q8 import (
    FAST_ROWS,
    MAX_ROWS,
    TILE_ENTRIES,
    TILE_N,
    amx_available,
    matvec_entry,
    tile_kernel,
    vnni_available,
    vnni_entry,
)

BLOCK = 32  # inputs in one group of a scale (Q6_K: two groups of 16)
_HALVES, _F16_SCALES, _BF16_OUT, _ARGMAX_OUT, _PACK4, _PACK5 = (
    build.constants()[f"Q8_{n}"]  # the tile kernels' flags
    for n in ("HALVES", "F16_SCALES", "BF16_OUT", "ARGMAX_OUT", "PACK4", "PACK5"))


class Q8Weight:
    """An [N, K] weight as int8 values q, a float32 scale per group of 32 (or 16) along K
    and optionally an offset per group: w = q * scale - offset (GGUF's K-quants keep a
    minimum per 32). In rows (q [N, K], scales and offsets [N, K / group]) or in AMX tiles
    (q [N/16, K/32, 16, 16, 2], scales [N/16, K/32, (2,) 16], float16 where that is exact;
    see `to_tiles`)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None = None, group: int = BLOCK):
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % BLOCK:
            raise ValueError(f"Q8Weight: int8 [N, K] with K % {BLOCK} == 0, got {q.dtype} "
                             f"{tuple(q.shape)}")
        if group not in (16, BLOCK):
            raise ValueError(f"Q8Weight: group {group}, not 16 or {BLOCK}")
        self.q = q.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self.offsets = None if offsets is None else offsets.to(torch.float32).contiguous()
        want = (q.shape[0], q.shape[1] // group)
        if self.scales.shape != want or (self.offsets is not None and self.offsets.shape != want):
            raise ValueError(f"Q8Weight: scales {tuple(scales.shape)} do not match "
                             f"{tuple(q.shape)} in groups of {group}")
        self.shape = (q.shape[0], q.shape[1])
        self.group = group
        self.tiled = False
        self.packed: tuple[torch.Tensor, int] | None = None  # (bytes, flag): see `to_tiles`
        # the most rows the tiles take to q8_vnni (None: `vnni_rows()`; an LM head's:
        # `head_vnni_rows()`, set by the model)
        self.vnni_limit: int | None = None
        # q8_dpbusd (int8 activations) in q8_dpbf16's place, set by the model
        self.int8_activations = False

    @property
    def plain(self) -> bool:
        """One scale per 32 and no offsets: what q8_matvec takes."""
        return self.group == BLOCK and self.offsets is None

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
    def from_q4_k_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        """From GGUF Q4_K data: super-blocks of 256 (144 bytes): float16 d and dmin, 12
        bytes of 6-bit scales and minimums for 8 groups of 32, 128 bytes of nibbles (bytes
        32i..32i+31 hold group 2i low, 2i+1 high); value = d * sc * q - dmin * min."""
        sb = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // 256, 144)
        d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)  # [S, 1]
        dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float32)
        a, b, c = sb[:, 4:8], sb[:, 8:12], sb[:, 12:16]
        # groups 0-3: low 6 bits of a (scales) and b (minimums); groups 4-7: a nibble of c
        # joined with the top 2 bits of a (scales) or b (minimums)
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1).astype(np.float32)
        mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1).astype(np.float32)
        nib = sb[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
        q = (nib & 15).reshape(n, k).astype(np.int8)
        return cls(torch.from_numpy(q), torch.from_numpy((d * sc).reshape(n, k // BLOCK)),
                   torch.from_numpy((dmin * mn).reshape(n, k // BLOCK)))

    @classmethod
    def from_q6_k_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        """From GGUF Q6_K data: super-blocks of 256 (210 bytes): 128 bytes of low nibbles,
        64 of high 2-bit pairs, 16 int8 scales (one per 16 values), a float16 d;
        value = d * scale * (6 bits - 32)."""
        sb = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // 256, 210)
        low = sb[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]
        high = sb[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                 dtype=np.uint8)[:, None]
        q = ((low & 15).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)).astype(np.int16)
        sc = sb[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = sb[:, 208:210].copy().view(np.float16).astype(np.float32)
        return cls(torch.from_numpy((q - 32).astype(np.int8).reshape(n, k)),
                   torch.from_numpy((d * sc).reshape(n, k // 16)), group=16)

    @classmethod
    def stack(cls, parts: list[Q8Weight]) -> Q8Weight | None:
        """Rows of several weights one after the other (q, k, v -> qkv); None when their
        groups or offsets differ."""
        if any(p.tiled for p in parts):
            raise ValueError("Q8Weight.stack: stack row-major weights, then tile them")
        if len({(p.group, p.offsets is None) for p in parts}) != 1:
            return None
        offsets = None if parts[0].offsets is None else torch.cat([p.offsets for p in parts])
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                   offsets, parts[0].group)

    def to_tiles(self) -> Q8Weight:
        """The same weight in AMX tile order: block (n, b) of 16 outputs x 32 inputs holds,
        for each input pair p, the two values of each output in turn (q[n*16 + j, b*32 +
        2p + i] at [n, b, p, j, i]). Needs N % 16 == 0."""
        if self.tiled:
            return self
        n, k = self.shape
        if n % TILE_N:
            raise ValueError(f"Q8Weight.to_tiles: N = {n} is not a multiple of {TILE_N}")
        t = Q8Weight.__new__(Q8Weight)
        t.q = self.q.view(n // TILE_N, TILE_N, k // BLOCK, 16, 2).permute(0, 2, 3, 1, 4)
        t.q = t.q.contiguous()
        t.scales, t.offsets = (None if g is None else self._group_tiles(g)
                               for g in (self.scales, self.offsets))
        half = t.scales.to(torch.float16)
        if torch.equal(half.float(), t.scales):  # Q8_0, Q5_0: float16 in the file
            t.scales = half
        t.shape, t.group, t.tiled, t.vnni_limit = self.shape, self.group, True, self.vnni_limit
        t.int8_activations = self.int8_activations
        t.packed = t._pack()
        return t

    def take(self, outputs: torch.Tensor) -> Q8Weight:
        """The tiled weight of `outputs` (int64 indices, a multiple of 16 of them), in that
        order, each with its values and scales as they are here: a tile kernel gives each
        output the very sums it gives here (an output's sums do not depend on its tile's
        other outputs)."""
        if not self.tiled or outputs.dim() != 1 or outputs.numel() % TILE_N:
            raise ValueError("Q8Weight.take: a tiled weight and a multiple of "
                             f"{TILE_N} outputs")
        blk, lane = outputs // TILE_N, outputs % TILE_N

        def pick(g: torch.Tensor | None) -> torch.Tensor | None:
            """[N/16, ..., 16] (an output's lane last) -> the outputs' [len/16, ..., 16]"""
            if g is None:
                return None
            rest = g.shape[1:-1]
            picked = g.view(g.shape[0], -1, TILE_N)[blk, :, lane]  # [outputs, prod(rest)]
            return picked.view(-1, TILE_N, *rest).movedim(1, -1).contiguous()

        t = Q8Weight.__new__(Q8Weight)
        # an output's pair of values in a tile row as one int16
        t.q = pick(self.q.view(torch.int16).squeeze(-1)).unsqueeze(-1).view(torch.int8)
        t.scales, t.offsets = pick(self.scales), pick(self.offsets)
        t.shape, t.group, t.tiled = (outputs.numel(), self.shape[1]), self.group, True
        t.vnni_limit, t.packed = self.vnni_limit, None
        t.int8_activations = self.int8_activations
        return t

    def _pack(self) -> tuple[torch.Tensor, int] | None:
        """The tiles' values in as many bits as the file has, for q8_vnni (whose few rows
        wait on the bytes they read; q8_amx reads the int8 tiles): Q4_K's q in 0..15 as
        4 bits (Q8_PACK4), Q5_0's q in -16..15 as 5 bits of q + 16 (Q8_PACK5). Per block,
        16 input pairs x 16 bytes of nibbles (values 2b and 2b + 1 in byte b), then for 5
        bits a uint32 of fifth bits per pair. The kernel unpacks the same int16 values as
        from the int8 tiles: the same sums, bit for bit. None for other ranges."""
        if self.group != BLOCK:
            return None
        lo, hi = int(self.q.min()), int(self.q.max())
        if self.offsets is not None and lo >= 0 and hi < 16:
            bits, flag = 4, _PACK4
        elif self.offsets is None and lo >= -16 and hi < 16:
            bits, flag = 5, _PACK5
        else:
            return None
        u = (self.q.view(-1, 16, 32).to(torch.int16) + (16 if bits == 5 else 0)).to(torch.uint8)
        nibbles = ((u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)).reshape(-1, 256)
        if bits == 5:
            fifth = ((u >> 4) & 1).to(torch.int64) << torch.arange(32)
            words = fifth.sum(-1).numpy().astype(np.uint32)  # [blocks, 16]
            top = torch.from_numpy(words.view(np.uint8).reshape(-1, 64).copy())
            nibbles = torch.cat([nibbles, top], dim=1)
        return nibbles.contiguous().view(torch.int8).view(-1), flag

    def _group_tiles(self, g: torch.Tensor) -> torch.Tensor:
        """[N, K / group] -> [N/16, K/32, (halves,) 16]"""
        n, k = self.shape
        per = BLOCK // self.group
        return g.view(n // TILE_N, TILE_N, k // BLOCK, per).permute(0, 2, 3, 1).reshape(
            n // TILE_N, k // BLOCK, *([per] if per > 1 else []), TILE_N).contiguous()

    def for_activations(self, dtype: torch.dtype) -> Q8Weight | None:
        """The layout the fastest kernel here takes for activations of `dtype`; None when
        no kernel here takes this weight."""
        if (dtype == torch.bfloat16 and self.shape[0] % TILE_N == 0
                and (amx_available() or vnni_available())):
            return self.to_tiles()
        return self if self.plain else None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K], scales, offsets [N, K / group] or None) whichever the layout."""
        if not self.tiled:
            return self.q, self.scales, self.offsets
        n, k = self.shape

        def ungroup(g):
            if g is None:
                return None
            g = g.float().view(n // TILE_N, k // BLOCK, BLOCK // self.group, TILE_N)
            return g.permute(0, 3, 1, 2).reshape(n, k // self.group)

        return (self.q.permute(0, 3, 1, 2, 4).reshape(n, k), ungroup(self.scales),
                ungroup(self.offsets))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as GGUF dequantizes: q * scale (exact), minus the offset."""
        n, k = self.shape
        q, scales, offsets = self.rows()
        w = q.view(n, k // self.group, self.group).float() * scales[:, :, None]
        if offsets is not None:
            w = w - offsets[:, :, None]
        return w.view(n, k)

    def takes(self, x: torch.Tensor, kernel: str | None = None) -> bool:
        """Whether `matmul` runs x here at least as fast as the bf16 copy would (with
        `kernel`, "vnni", "amx" or "dpbf16": whether that kernel takes x)."""
        if self.tiled:
            return (x.dtype == torch.bfloat16
                    and self.kernel_for(x.shape[0], kernel) is not None)
        return x.shape[0] <= FAST_ROWS and self.plain

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, kernel: str | None = None
               ) -> torch.Tensor | None:
        """x [M, K] (CPU) @ W.T, float32 sums, as `dtype` (float32 or bf16, each sum rounded
        once) or into `out` (contiguous [M, N] of either); None when no kernel here takes
        it. Tiles take bf16 x: up to vnni_rows() rows through q8_vnni (the exact weights,
        int16 activations), more through q8_amx or, without AMX, q8_dpbf16 (the bf16 copy's
        weights); `kernel` ("vnni", "amx", "dpbf16") picks one whatever the rows. Rows take
        up to MAX_ROWS rows. The tile kernels write bf16 themselves (a cast after would be a
        second pass over every output); the rows kernel writes float32, cast here."""
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.shape[1]:
            return None
        shape = (x.shape[0], self.shape[0])
        if out is not None and (out.shape != shape or not out.is_contiguous()
                                or out.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"Q8Weight.matmul: out must be contiguous float32 or bf16 "
                             f"{list(shape)}, got {out.dtype} {tuple(out.shape)}")
        if self.tiled:
            kernel = self.kernel_for(x.shape[0], kernel, any_rows=True)
            fn = TILE_ENTRIES[kernel]() if kernel is not None else None
            y = out if out is not None else torch.empty(shape, dtype=dtype)
            return self._run_tiles(fn, x, y)
        sums = out if out is not None and out.dtype == torch.float32 else torch.empty(shape)
        y = self._run_matvec(x, sums)
        if y is None or out is y:
            return y
        return out.copy_(y) if out is not None else y.to(dtype)

    def argmax(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor | None:
        """int64 [M]: each row's first index of its largest x @ W.T sum, without writing the
        sums: `matmul(x, kernel=kernel).argmax(-1)` exactly (the same float32 sums, ties to
        the first), from whichever tile kernel `matmul` would run. None where the caller
        would multiply otherwise (the rows layout, or bf16 for a prompt chunk past
        PROMPT_AMX_ROWS), or a sum is NaN."""
        if (not self.tiled or x.dim() != 2 or x.shape[1] != self.shape[1]
                or not self.takes(x, kernel)):
            return None
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        entry = TILE_ENTRIES[self.kernel_for(x.shape[0], kernel, any_rows=True)]
        return self._run_tiles(entry(), x, tokens, _ARGMAX_OUT)

    def kernel_for(self, m: int, kernel: str | None = None, any_rows: bool = False
                   ) -> str | None:
        """`tile_kernel` for m rows of this tiled weight (its q8_vnni limit and
        activations)."""
        return tile_kernel(m, kernel, any_rows, self.vnni_limit, self.int8_activations)

    def tiles_for(self, kernel: str) -> tuple[torch.Tensor, int]:
        """(the values, the flags) tile kernel `kernel` reads: q8_vnni the packed values
        where this weight has them, q8_amx and q8_dpbf16 the int8 tiles."""
        if kernel == "vnni" and self.packed is not None:
            packed, flag = self.packed
            return packed, self.tile_flags | flag
        return self.q, self.tile_flags

    @property
    def tile_flags(self) -> int:
        """The tile kernels' flags for this weight's scales (kernels.h: Q8_HALVES, Q8_F16_SCALES)."""
        return (self.group == 16) * _HALVES | (self.scales.dtype == torch.float16) * _F16_SCALES

    def _run_tiles(self, fn, x: torch.Tensor, y: torch.Tensor,
                   out_flag: int = 0) -> torch.Tensor | None:
        """A tile kernel (q8_vnni, q8_amx, q8_dpbf16: the same arguments) on this tiled
        weight, into y: its sums, or with out_flag _ARGMAX_OUT each row's argmax"""
        if fn is None or x.dtype != torch.bfloat16:
            return None
        x = x.contiguous()
        m, k = x.shape
        if m < 1:
            return None
        offsets = 0 if self.offsets is None else self.offsets.data_ptr()
        vnni = fn is vnni_entry()
        q, flags = self.tiles_for("vnni" if vnni else "amx")  # the others read the int8 tiles
        flags |= (y.dtype == torch.bfloat16) * _BF16_OUT | out_flag
        rc = fn(x.data_ptr(), q.data_ptr(), self.scales.data_ptr(), offsets, flags,
                y.data_ptr(), m, self.shape[0], k, torch.get_num_threads())
        return y if rc == 0 else None

    def _run_matvec(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Rows layout (`matmul` checked device and shape): None when the kernel is absent
        or does not take this weight or this many rows."""
        fn = matvec_entry()
        if fn is None or not self.plain or x.shape[0] > MAX_ROWS:
            return None
        xf = x.to(torch.float32).contiguous()
        m, k = xf.shape
        n = self.q.shape[0]
        rc = fn(xf.data_ptr(), self.q.data_ptr(), self.scales.data_ptr(), y.data_ptr(),
                m, n, k, torch.get_num_threads())
        return y if rc == 0 else None
