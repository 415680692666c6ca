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


class _Cursor:
    """Little-endian values read in turn from a GGUF header's bytes."""

    def __init__(self, data: bytes, pos: int = 0):
        self.view, self.pos = memoryview(data), pos

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.view):
            raise GGUFFormatError("truncated GGUF header")
        (val,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += size
        return val

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.view):
            raise GGUFFormatError("truncated GGUF string")
        s = bytes(self.view[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, t: int) -> Any:
        if t in _SCALARS:
            return self.take(_SCALARS[t])
        if t == _STRING:
            return self.string()
        raise GGUFFormatError(f"bad GGUF value type {t}")

    def skip(self, t: int, n: int = 1) -> None:
        """Past n values of type t without building them."""
        if t in _SCALARS:
            self.pos += n * struct.calcsize(_SCALARS[t])
            return
        for _ in range(n):
            if t != _STRING:
                raise GGUFFormatError(f"bad GGUF value type {t}")
            n_bytes = self.take("<Q")  # before `pos` is read: take moves it
            self.pos += n_bytes


def _read_header(path: str | Path, max_array: int, tensors: bool = False):
    """(metadata, tensor infos or None, the offset where the header ends)."""
    with open(path, "rb") as fh:
        data = fh.read(64 * 1024 * 1024) if Path(path).stat().st_size > 0 else b""
    if data[:4] != b"GGUF":
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur = _Cursor(data, 4)
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    tensor_count = cur.take("<Q")
    kv_count = cur.take("<Q")
    meta: dict[str, Any] = {"GGUF.version": version}
    for _ in range(kv_count):
        _read_kv(cur, meta, max_array)
    if not tensors:
        return meta, None, cur.pos
    infos = {}
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        ggml_type = cur.take("<I")
        infos[name] = (dims, ggml_type, cur.take("<Q"))
    return meta, infos, cur.pos


def _read_kv(cur: _Cursor, meta: dict[str, Any], max_array: int) -> None:
    """One key and its value into meta; an array past max_array as its length ("key#len")."""
    key = cur.string()
    t = cur.take("<I")
    if t != _ARRAY:
        meta[key] = cur.value(t)
        return
    et, n = cur.take("<I"), cur.take("<Q")
    if n > max_array:
        meta[key + "#len"] = n
        cur.skip(et, n)
    else:
        meta[key] = [cur.value(et) for _ in range(n)]
