"""int8 weights with a float scale per 32 (GGUF Q8_0): exact, and half the bytes of bf16.

At batch 1 a decode step is bound by the bytes of weights it reads; the 640 x 262,144 LM
head of the bundled model is Q8_0 in its GGUF, so it is kept as int8 + scales beside its
bf16 copy (which larger batches multiply on AMX) and small batches go through
`q8_matvec.c`. The kernel is compiled on first use with the system's C compiler
(-O3 -march=native) into the swaserve cache; without a compiler the bf16 path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("swaserve")

BLOCK = 32
MAX_ROWS = 8  # rows of activations one call takes (q8_matvec.c)
_SOURCE = Path(__file__).with_name("q8_matvec.c")
_lib = None
_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    base = os.environ.get("SWASERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "swaserve")
    return Path(base) / "kernels"


def _load():
    """The compiled kernel, built once per source and machine; None when it cannot be."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SWASERVE_NO_KERNELS") == "1":
            return None
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            log.info("no C compiler: int8 matrix-vector kernel off, bf16 used instead")
            return None
        src = _SOURCE.read_bytes()
        tag = hashlib.sha256(src + os.uname().machine.encode()).hexdigest()[:16]
        lib = _cache_dir() / f"q8_matvec-{tag}.so"
        if not lib.exists() and not _compile(cc, lib):
            return None
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError as e:
            log.warning("int8 kernel did not load, bf16 used instead: %s", e)
            return None
        fn = handle.q8_matvec
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        _lib = fn
        return _lib


def _compile(cc: str, lib: Path) -> bool:
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-pthread",
               str(_SOURCE), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("int8 kernel could not be built, bf16 used instead: %s", e)
        return False
    if r.returncode != 0:
        os.unlink(tmp)
        log.warning("int8 kernel did not compile, bf16 used instead: %s", r.stderr.strip()[:300])
        return False
    os.replace(tmp, lib)  # atomic: a concurrent start sees the whole library or none
    return True


def available() -> bool:
    return _load() is not None


class Q8Weight:
    """An [N, K] weight as int8 values and float32 scales per block of 32 along K."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % BLOCK:
            raise ValueError(f"Q8Weight: int8 [N, K] with K % {BLOCK} == 0, got {q.dtype} "
                             f"{tuple(q.shape)}")
        self.q = q.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        if self.scales.shape != (q.shape[0], q.shape[1] // BLOCK):
            raise ValueError(f"Q8Weight: scales {tuple(scales.shape)} do not match {tuple(q.shape)}")

    @classmethod
    def from_q8_0_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        """From GGUF Q8_0 data: per block of 32, a float16 scale then 32 int8 values."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 2 + BLOCK)
        d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
        return cls(torch.from_numpy(q), torch.from_numpy(d))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, k // BLOCK, BLOCK).float() * self.scales[:, :, None]).view(n, k)

    def matvec(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] (M <= MAX_ROWS, CPU) @ W.T in float32; None when the kernel is absent."""
        fn = _load()
        if fn is None or x.shape[0] > MAX_ROWS or x.device.type != "cpu":
            return None
        xf = x.to(torch.float32).contiguous()
        m, k = xf.shape
        n = self.q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        rc = fn(xf.data_ptr(), self.q.data_ptr(), self.scales.data_ptr(), y.data_ptr(),
                m, n, k, torch.get_num_threads())
        return y if rc == 0 else None
