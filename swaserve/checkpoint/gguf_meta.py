"""A fast reader of GGUF key/value metadata (the header only; tensors are left alone).

gguf.GGUFReader builds Python objects for every vocabulary string (seconds for a 262k
vocabulary); planning and config need only the scalars, so arrays longer than
`max_array` are skipped and only their length is kept (as "key#len")."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


def read_gguf_metadata(path: str | Path, max_array: int = 1024) -> dict[str, Any]:
    return _read_header(path, max_array)[0]


def read_gguf_tensor_infos(path: str | Path) -> tuple[dict[str, tuple[tuple[int, ...], int, int]],
                                                        int]:
    """{name: (dims, ggml type, offset)} and the file offset where tensor data starts;
    dims as GGUF stores them (innermost first), offsets relative to the data start."""
    meta, infos, end = _read_header(path, 1024, tensors=True)
    align = int(meta.get("general.alignment", 32))
    return infos, (end + align - 1) // align * align


def _read_header(path: str | Path, max_array: int, tensors: bool = False):
    with open(path, "rb") as fh:
        data = fh.read(64 * 1024 * 1024) if Path(path).stat().st_size > 0 else b""
    view = memoryview(data)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(view):
            raise GGUFFormatError("truncated GGUF header")
        (val,) = struct.unpack_from(fmt, view, pos)
        pos += size
        return val

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(view):
            raise GGUFFormatError("truncated GGUF string")
        s = bytes(view[pos:pos + n]).decode("utf-8", errors="replace")
        pos += n
        return s

    def skip_value(t: int) -> None:
        nonlocal pos
        if t == _STRING:
            n = take("<Q")
            pos += n
        elif t in _SCALARS:
            pos += struct.calcsize(_SCALARS[t])
        else:
            raise GGUFFormatError(f"bad GGUF value type {t}")

    def value(t: int) -> Any:
        if t in _SCALARS:
            return take(_SCALARS[t])
        if t == _STRING:
            return string()
        raise GGUFFormatError(f"bad GGUF value type {t}")

    if data[:4] != b"GGUF":
        raise GGUFFormatError("not a GGUF file (bad magic)")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    tensor_count = take("<Q")
    kv_count = take("<Q")
    meta: dict[str, Any] = {"GGUF.version": version}
    for _ in range(kv_count):
        key = string()
        t = take("<I")
        if t != _ARRAY:
            meta[key] = value(t)
            continue
        et, n = take("<I"), take("<Q")
        if n > max_array:
            meta[key + "#len"] = n
            if et in _SCALARS:
                pos += n * struct.calcsize(_SCALARS[et])
            else:
                for _ in range(n):
                    skip_value(et)
        else:
            meta[key] = [value(et) for _ in range(n)]
    if not tensors:
        return meta, None, pos
    infos = {}
    for _ in range(tensor_count):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        ggml_type = take("<I")
        infos[name] = (dims, ggml_type, take("<Q"))
    return meta, infos, pos
