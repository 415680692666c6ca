"""The q8 kernels (q8.c, built by kernels/build.py) and which one multiplies a product of m
rows by a `Q8Weight` (q8_weight.py); without a compiler, none does and the bf16 copy is used.

- `q8_vnni` (AVX-512 VNNI) writes each row of activations as int16 with a power of two per
  32 inputs and multiplies the int8 values themselves (exact integer sums per group, scales
  and offsets applied in float32): the file's exact weights. One pass keeps VNNI_CHUNK rows
  in registers, so it takes decode steps of a few rows.
- `q8_amx` widens a block to bf16 (q * scale - offset, rounded once: the very values of the
  bf16 copy) and multiplies it on the tile unit, any number of rows.
- `q8_dpbf16` multiplies the same widened tiles with AVX-512 BF16 dot products (VDPBF16PS),
  any number of rows: q8_amx's place on CPUs without AMX (AMD Zen 4 and 5).
- `q8_dpbusd` (an engine option, `int8_activations`, off by default) takes q8_dpbf16's place
  with int8 activations, a scale per 32 inputs (VPDPBUSD): faster, further from exact.
- `q8_matvec` (float32 FMAs, row-major weights, up to MAX_ROWS rows): the fallback where
  no tile kernel is built.

A prompt step's rows must not depend on the others of the call (a prefix hit recomputes a
short tail of what a cold run did in one chunk), so it takes q8_amx or q8_dpbf16 only. Each
row limit below says at its constant why it sits there.
"""

from __future__ import annotations

import torch

from swaserve.kernels import build

MAX_ROWS = build.constants()["Q8_MAX_ROWS"]  # rows one q8_matvec call takes
FAST_ROWS = 4  # up to this many rows q8_matvec beats bf16
# a step with prompt rows (kernel "amx") goes to q8_amx up to this many rows (faster than
# bf16 for a whole prefill) and to bf16 above; a decode step takes q8_amx at any size
PROMPT_AMX_ROWS = 256
# without AMX, a step with prompt rows (kernel "dpbf16") goes to q8_dpbf16 up to this many
# rows (faster than bf16 there) and to bf16 above, where the two run alike
PROMPT_DPBF16_ROWS = 512
# with AMX, q8_vnni takes decode steps up to this many rows (one pass) and q8_amx those past
# them, where the tile unit is faster
VNNI_ROWS = 8
# without AMX, q8_vnni takes decode steps up to the rows of one pass and q8_dpbf16 those
# past them; without AVX-512 BF16 either, q8_vnni goes on to this many rows, where it still
# beats bf16
VNNI_SPLIT_ROWS = 16
# an LM head, which a step streams from memory whatever its rows, stays on q8_vnni up to
# this many rows where q8_dpbf16 would take the rows past VNNI_CHUNK (the layers' weights,
# a few MB each, are faster on q8_dpbf16 from there)
HEAD_VNNI_ROWS = 16
VNNI_CHUNK = build.constants()["Q8_VNNI_CHUNK"]  # rows one q8_vnni pass keeps in registers
TILE_N = 16  # outputs in one AMX tile
_amx_ok: bool | None = None
_vnni_ok: bool | None = None
_dpbf16_ok: bool | None = None
_dpbusd_ok: bool | None = None


def matvec_entry():
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
    return matvec_entry() is not None


def probe_block(vnni: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, scales, flags) of one tile block of 16 outputs x 32 inputs, every value 1
    and every scale 0.5 (a float16), as `Q8Weight.to_tiles()` lays it out: the same in any
    order, and for q8_vnni in its 5-bit packing (each byte two nibbles of 1 + 16, then a
    word of fifth bits per input pair)."""
    flags = build.constants()["Q8_F16_SCALES"]
    scales = torch.full((TILE_N,), 0.5, dtype=torch.float16)
    if not vnni:
        return torch.ones(TILE_N * 32, dtype=torch.int8), scales, flags
    nibbles = torch.full((256,), 0x11, dtype=torch.uint8)
    fifths = torch.full((64,), 0xFF, dtype=torch.uint8)
    values = torch.cat([nibbles, fifths]).view(torch.int8)
    return values, scales, flags | build.constants()["Q8_PACK5"]


def _works(fn, tolerance: float = 0.0) -> bool:
    """Whether tile kernel `fn` runs here and multiplies right (one real product, within
    `tolerance` of 16)."""
    if fn is None:
        return False
    q, scales, flags = probe_block(fn is vnni_entry())
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    y = torch.empty(1, TILE_N)
    rc = fn(x.data_ptr(), q.data_ptr(), scales.data_ptr(), 0, flags, y.data_ptr(), 1, TILE_N,
            32, torch.get_num_threads())
    return rc == 0 and bool(((y - 16.0).abs() <= tolerance).all())


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
