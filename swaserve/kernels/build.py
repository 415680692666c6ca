"""Small C kernels, compiled on first use with the system's C compiler (-O3 -march=native,
so they vectorise for the machine that runs them) into the directory `use_cache_dir` gives,
and loaded with ctypes. Without a compiler, or with SWASERVE_NO_KERNELS=1, `load` returns
None and callers keep their torch path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("swaserve")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_functions: dict[tuple[str, str], object] = {}
_cache_dir: Path | None = None


def use_cache_dir(path: str | os.PathLike) -> None:
    """Where this process's kernels are built and kept, given from above the kernels
    (model loading: the swaserve cache's kernels/; tests and benchmarks that call a kernel
    first). Given once: the same directory again changes nothing, another raises
    ValueError, so every library a process loads comes from one place."""
    global _cache_dir
    path = Path(path)
    with _lock:
        if _cache_dir is not None and _cache_dir != path:
            raise ValueError(f"kernel cache: already {_cache_dir}, not {path}")
        _cache_dir = path


def cache_dir() -> Path:
    """The directory `use_cache_dir` gave; RuntimeError before one is given."""
    if _cache_dir is None:
        raise RuntimeError("kernels: no cache directory: call kernels.build.use_cache_dir "
                           "before the first kernel")
    return _cache_dir


_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _header() -> str:
    return Path(__file__).with_name("kernels.h").read_text()


@functools.cache
def constants() -> dict[str, int]:
    """The shared flags and limits, read from kernels.h (the one place they are written)."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^#define (\w+) (\d+)\b", _header(), re.M)}


@functools.cache
def signatures() -> dict[str, tuple[object, list]]:
    """symbol -> (restype, argtypes) for ctypes, from the prototypes in kernels.h."""
    out = {}
    text = re.sub(r"/\*.*?\*/", "", _header(), flags=re.S)
    for ret, name, args in re.findall(r"^(int|void) (\w+)\(([^)]*)\);", text, re.M):
        argtypes = []
        for arg in args.split(","):
            words = arg.replace("const ", "").replace("struct ", "").split()
            argtypes.append(ctypes.c_void_p if "*" in arg else _CTYPES[words[0]])
        out[name] = (_CTYPES.get(ret), argtypes)
    return out


def load(name: str) -> ctypes.CDLL | None:
    """The library built from `<name>.c` beside this file (once per source and machine)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def function(library: str, symbol: str):
    """`symbol` of kernel `library` with its C signature (from kernels.h) set, or None when
    it cannot be built here. Looked up once: kernels are called ~100 times a decode step,
    and the library lock and signature setting cost more than a small kernel's work."""
    key = (library, symbol)
    fn = _functions.get(key)
    if fn is None and key not in _functions:
        lib = load(library)
        if lib is not None:
            fn = getattr(lib, symbol)
            fn.restype, fn.argtypes = signatures()[symbol]
        _functions[key] = fn
    return fn


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("SWASERVE_NO_KERNELS") == "1":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: %s kernel off, torch used instead", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    # -march=native code must never be loaded on another CPU (a shared home directory):
    # the CPU's feature flags are part of the name
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    tag = hashlib.sha256(source.read_bytes() + headers + os.uname().machine.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    lib = cache_dir() / f"{name}-{tag}.so"
    if not lib.exists() and not compile_library(cc, source, lib):
        return None
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        log.warning("%s kernel did not load, torch used instead: %s", name, e)
        return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def compile_library(cc: str, source: Path, lib: Path, arch: str = "native") -> bool:
    """`source` built into `lib` for CPU `arch` (-march: this CPU, or e.g. x86-64-v3 to
    build the loops of a CPU without AVX-512); False when it cannot be."""
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        # OpenMP where the compiler has it (the kernels then share torch's worker threads)
        for threads in ("-fopenmp", "-fopenmp-simd"):
            cmd = [cc, "-O3", f"-march={arch}", threads, "-fPIC", "-shared", "-pthread",
                   str(source), "-o", tmp, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                break
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("%s kernel could not be built, torch used instead: %s", source.stem, e)
        return False
    if r.returncode != 0:
        os.unlink(tmp)
        log.warning("%s kernel did not compile, torch used instead: %s", source.stem,
                    r.stderr.strip()[:300])
        return False
    os.replace(tmp, lib)  # atomic: a concurrent start sees the whole library or none
    for old in lib.parent.glob(f"{source.stem}-*.so"):  # builds of earlier sources
        if old != lib:
            try:
                old.unlink()
            except OSError:
                pass
    return True
