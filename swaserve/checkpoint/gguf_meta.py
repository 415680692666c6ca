"""A fast reader of GGUF key/value metadata (the header, and the few tensor facts a config
needs), and the names of GGML's tensor types.

gguf.GGUFReader builds Python objects for every vocabulary string (seconds for a 262k
vocabulary); planning and config need only the scalars, so arrays longer than
`max_array` are skipped and only their length is kept (as "key#len")."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path
from typing import Any

# GGML tensor type ids (ggml.h) -> names
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0"}
# the types swaserve reads (checkpoint/weights.py dequantizes them with the gguf package)
GGML_READABLE = frozenset(i for i, name in GGML_TYPE_NAMES.items() if name in {
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"})
_GGML_F32 = 0


def ggml_type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


def read_gguf_metadata(path: str | Path, max_array: int = 1024) -> dict[str, Any]:
    """The key/values, and from the tensor table what a config needs: "GGUF.tensor_types"
    ({tensor name: GGML type id}) and, where the file has Llama 3's RoPE frequency factors
    (the `rope_freqs.weight` tensor, F32), their values as "GGUF.rope_freqs"; where it has
    Gemma 4's per-layer input table, its row count as "GGUF.per_layer_vocab"."""
    meta, infos, end = _read_header(path, max_array, tensors=True)
    meta["GGUF.tensor_types"] = {name: info[1] for name, info in infos.items()}
    ple = infos.get("per_layer_token_embd.weight")
    if ple is not None:
        meta["GGUF.per_layer_vocab"] = int(ple[0][-1])  # dims innermost first: [n * P, V]
    rope = infos.get("rope_freqs.weight")
    if rope is not None and rope[1] == _GGML_F32 and len(rope[0]) == 1:
        align = int(meta.get("general.alignment", 32))
        with open(path, "rb") as fh:
            fh.seek((end + align - 1) // align * align + rope[2])
            values = array("f", fh.read(4 * rope[0][0]))
        meta["GGUF.rope_freqs"] = values.tolist()
    return meta


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
