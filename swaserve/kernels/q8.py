"""GGUF weights as int8 values with a float scale (and offset) per group: exact, and about
half the bytes of bf16.

A decode step is bound by the bytes of weights it reads. The bundled model's GGUF stores
its LM head (640 x 262,144) as Q8_0, q/k/v and gate/up as Q5_0 or Q8_0, attention outputs
as Q4_K and down projections as Q4_K or Q6_K; all of them read as int8 + scales (+ offsets
for Q4_K) are the file's weights bit for bit. They are kept beside their bf16 copies (which
prefill chunks multiply) and decode batches go through `q8.c` (built by kernels/build.py;
without a compiler the bf16 path is used). Two layouts:

- row-major [N, K] for `q8_matvec` (float32 AVX-512 FMAs, up to MAX_ROWS rows, Q8_0 and
  Q5_0 only): the fallback on CPUs without AMX;
- tiles (`to_tiles`, on CPUs with AMX or AVX-512 VNNI, for bf16 activations): each block
  of 16 outputs x 32 inputs in the pair-interleaved order of an AMX tile. Tiles of Q5_0
  and Q4_K values are also kept packed in 5 and 4 bits (`_pack`), which q8_vnni reads
  instead (a batch-1 step waits on the bytes it reads; the same bits come out). Up to
  VNNI_ROWS rows (`vnni_rows()` on CPUs without AMX; an LM head, streamed from memory
  whatever the rows, to `head_vnni_rows()`) `q8_vnni` writes each row of
  activations as int16 with a power of two per 32 inputs and multiplies the int8 values
  themselves (VPDPWSSD, exact integer sums per group, scales and offsets applied in
  float32): the file's exact weights, ~1e-5 from a float64 product where the bf16 copy's
  weights are ~2e-3 off. More rows go to `q8_amx`,
  which widens a block to bf16 (q * scale - offset, rounded once: the very values of the
  bf16 copy) and multiplies it on the tile unit, for any number of rows. On CPUs without
  AMX, `q8_dpbf16` multiplies the same widened tiles with AVX-512 BF16 dot products
  (VDPBF16PS: AMD Zen 4 and 5), any number of rows, for decode steps past q8_vnni's and
  prompt chunks up to PROMPT_DPBF16_ROWS (a row's sums do not depend on the others of the
  call, and from int8 it is 4-14 % faster than bf16 there). With `int8_activations` (an
  engine option, off by default) a layer's weight takes `q8_dpbusd` in q8_dpbf16's place,
  any rows: int8 activations with a scale per 32 inputs (VPDPBUSD, twice VDPBF16PS's
  products an instruction), ~1.3x faster and ~5x further from exact. What each costs,
  and why the row limits are where they are: benchmarks/README.md (sessions 3, 5, 7, 16).
"""

from __future__ import annotations

import numpy as np
import torch

from swaserve.kernels import build

BLOCK = 32
MAX_ROWS = build.constants()["Q8_MAX_ROWS"]  # rows one q8_matvec call takes
FAST_ROWS = 4  # up to this many rows q8_matvec beats bf16 (benchmarks/README.md)
# q8_amx takes a decode step of any size: alone, one product at 128 rows is about as fast
# as bf16's and slower at 512, but in a step (the fused layers and the LM head) 64, 128
# and 256 rows ran 1.8x, 1.45x and 1.4x faster than bf16 (benchmarks/README.md, session 7).
# A step with prompt rows (kernel "amx") goes to it up to PROMPT_AMX_ROWS rows and to bf16
# above: whole prefills of 64 / 128 / 256 tokens ran 17-23 / 6-12 / 3-14 % faster on it
# than in bf16, 384-512 tokens 5-15 % slower (benchmarks/README.md, session 13)
PROMPT_AMX_ROWS = 256
# Without AMX a step with prompt rows (kernel "dpbf16") goes to q8_dpbf16 up to
# PROMPT_DPBF16_ROWS rows and to bf16 above: on AMD Zen 5, a prefill's 72 products from
# int8 (18 layers' weights in turn) at 128 / 512 / 1,024 / 2,048 rows ran 31 / 116 / 239 /
# 494 ms against bf16's 36 / 121-134 / 241 / 486 (benchmarks/README.md, session 22)
PROMPT_DPBF16_ROWS = 512
# with AMX, q8_vnni takes decode steps up to VNNI_ROWS rows (one pass) and q8_amx those
# past them: on a Xeon with AMX, steps at 7 / 8 rows (layers and head) ran 15.1 / 16.1 ms
# against 16.7 / 16.8 with the limit at 6, and 10 rows on q8_vnni (two passes) 23 against
# 18.7 (benchmarks/README.md, sessions 5 and 23)
VNNI_ROWS = 8
# without AMX, q8_vnni takes decode steps up to the rows one pass keeps in registers and
# q8_dpbf16 those past them; without AVX-512 BF16 either, q8_vnni goes on to
# VNNI_SPLIT_ROWS (on AMD Zen 5, against bf16: the LM head at 8 rows 8.3 ms against 16.2,
# at 16 14.8 against 19-26; benchmarks/README.md, sessions 16 and 17)
VNNI_SPLIT_ROWS = 16
# an LM head, whose 168 MB a step streams from memory whatever its rows, stays on q8_vnni
# up to HEAD_VNNI_ROWS rows where q8_dpbf16 takes the rows past VNNI_CHUNK (the layers'
# weights, a few MB each, are faster on q8_dpbf16 from there). AMD Zen 5, the head's
# argmaxes at 10 / 12 / 16 rows: q8_vnni 6.6 / 7.8 / 9.8 ms, q8_dpbf16 8.8 / 9.6 / 11.7;
# at 20 rows 12.5 and 12.7 (benchmarks/README.md, session 22)
HEAD_VNNI_ROWS = 16
VNNI_CHUNK = build.constants()["Q8_VNNI_CHUNK"]  # rows one q8_vnni pass keeps in registers
TILE_N = 16  # outputs in one AMX tile
_HALVES, _F16_SCALES, _BF16_OUT, _ARGMAX_OUT, _PACK4, _PACK5 = (
    build.constants()[f"Q8_{n}"]  # the tile kernels' flags
    for n in ("HALVES", "F16_SCALES", "BF16_OUT", "ARGMAX_OUT", "PACK4", "PACK5"))
_amx_ok: bool | None = None
_vnni_ok: bool | None = None
_dpbf16_ok: bool | None = None
_dpbusd_ok: bool | None = None


def _matvec():
    """A kernel's entry point, or None when it cannot be built here."""
    return build.function("q8", "q8_matvec")


def amx_entry():
    return build.function("q8", "q8_amx")


def vnni_entry():
    return build.function("q8", "q8_vnni")


def dpbf16_entry():
    return build.function("q8", "q8_dpbf16")


def dpbusd_entry():
    return build.function("q8", "q8_dpbusd")


TILE_ENTRIES = {"vnni": vnni_entry, "amx": amx_entry, "dpbf16": dpbf16_entry,
                "dpbusd": dpbusd_entry}


def available() -> bool:
    return _matvec() is not None


def _works(fn, tolerance: float = 0.0) -> bool:
    """Whether tile kernel `fn` runs here and multiplies right (one real product, within
    `tolerance` of 16)."""
    if fn is None:
        return False
    w = Q8Weight(torch.ones(TILE_N, BLOCK, dtype=torch.int8),
                 torch.full((TILE_N, 1), 0.5)).to_tiles()
    y = torch.empty(1, TILE_N)
    return w._run_tiles(fn, torch.ones(1, BLOCK, dtype=torch.bfloat16), y) is y and bool(
        ((y - 16.0).abs() <= tolerance).all())


def amx_available() -> bool:
    """The kernel was built with AMX and the OS grants this process the tile registers
    (checked once)."""
    global _amx_ok
    if _amx_ok is None:
        _amx_ok = _works(amx_entry())
    return _amx_ok


def vnni_available() -> bool:
    """The kernel was built with AVX-512 VNNI (checked once)."""
    global _vnni_ok
    if _vnni_ok is None:
        _vnni_ok = _works(vnni_entry())
    return _vnni_ok


def dpbf16_available() -> bool:
    """The kernel was built with AVX-512 BF16 (checked once)."""
    global _dpbf16_ok
    if _dpbf16_ok is None:
        _dpbf16_ok = _works(dpbf16_entry())
    return _dpbf16_ok


def tile_kernel(m: int, kernel: str | None = None, any_rows: bool = False,
                vnni_limit: int | None = None, int8: bool = False) -> str | None:
    """The tile kernel for m rows: `kernel` ("vnni", "amx", "dpbf16" or "dpbusd"; "amx" and
    "dpbf16" for a prompt chunk up to PROMPT_AMX_ROWS / PROMPT_DPBF16_ROWS, any m with `any_rows`)
    if it is here and takes them; without one, q8_vnni up to `vnni_limit` rows (default
    `vnni_rows()`), else q8_amx, else (no AMX) q8_dpbf16. With `int8` (a weight's
    `int8_activations`), q8_dpbusd takes q8_dpbf16's place, any rows. None when none does."""
    limit = vnni_rows() if vnni_limit is None else vnni_limit
    vnni = (kernel is not None or m <= limit) and vnni_available()
    amx = (kernel is None or m <= PROMPT_AMX_ROWS or any_rows) and amx_available()
    dpbusd = int8 and dpbf16_available() and dpbusd_available()  # in q8_dpbf16's place
    if kernel is not None:
        if kernel == "dpbf16" and dpbusd:
            return "dpbusd"
        dpbf16 = (m <= PROMPT_DPBF16_ROWS or any_rows) and dpbf16_available()
        ok = {"vnni": vnni, "amx": amx, "dpbf16": dpbf16, "dpbusd": dpbusd_available()}
        return kernel if ok[kernel] else None
    if vnni or amx:
        return "vnni" if vnni else "amx"
    if dpbusd:
        return "dpbusd"
    return "dpbf16" if dpbf16_available() else None


def dpbusd_available() -> bool:
    """The kernel was built with AVX-512 VNNI and its int8 product is right (checked once)."""
    global _dpbusd_ok
    if _dpbusd_ok is None:
        _dpbusd_ok = _works(dpbusd_entry(), tolerance=1e-4)
    return _dpbusd_ok


def prompt_kernel() -> str:
    """The tile kernel of a step with prompt rows: one whose rows do not depend on the
    others of the call (a prefix hit recomputes a short tail of what a cold run did in one
    chunk), q8_amx where it is here, else q8_dpbf16 (each to its PROMPT_*_ROWS)."""
    return "amx" if amx_available() or not dpbf16_available() else "dpbf16"


def vnni_rows() -> int:
    """The most rows of a decode step q8_vnni takes: VNNI_ROWS where q8_amx takes more,
    the rows of one pass where q8_dpbf16 does, VNNI_SPLIT_ROWS where only bf16 would."""
    if amx_available():
        return VNNI_ROWS
    return VNNI_CHUNK if dpbf16_available() else VNNI_SPLIT_ROWS


def head_vnni_rows() -> int:
    """The most rows an LM head takes to q8_vnni here: HEAD_VNNI_ROWS where q8_dpbf16
    would take the rows past `vnni_rows()`, `vnni_rows()` elsewhere (with AMX, q8_amx)."""
    if not amx_available() and dpbf16_available():
        return max(HEAD_VNNI_ROWS, vnni_rows())
    return vnni_rows()


def same_kernel_rows(m: int, tiled: bool = True, vnni_limit: int | None = None,
                     int8: bool = False) -> int:
    """The most rows a decode step of m rows may grow to and still take the kernel m rows
    take (for a weight with its own `vnni_limit` and `int8_activations`): rows do not
    depend on their batch within one kernel, but two kernels round differently."""
    unbounded = 1 << 62
    if tiled:
        if tile_kernel(m, vnni_limit=vnni_limit, int8=int8) != "vnni":
            return unbounded
        return vnni_rows() if vnni_limit is None else vnni_limit
    return FAST_ROWS if m <= FAST_ROWS else unbounded


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
        up to MAX_ROWS rows. The tile kernels write bf16 themselves (a cast after was a second
        pass over every output, ~2 ms of a batch-32 step); the rows kernel writes float32,
        cast here."""
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
        fn = _matvec()
        if fn is None or not self.plain or x.shape[0] > MAX_ROWS:
            return None
        xf = x.to(torch.float32).contiguous()
        m, k = xf.shape
        n = self.q.shape[0]
        rc = fn(xf.data_ptr(), self.q.data_ptr(), self.scales.data_ptr(), y.data_ptr(),
                m, n, k, torch.get_num_threads())
        return y if rc == 0 else None
