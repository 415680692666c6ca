"""Reading weights: GGUF files (dequantized with the gguf package; a split GGUF's parts
together) and safetensors.

Weights come out as (HF parameter name, tensor) pairs, so every model family has one
`load_weights` whatever the file format. Dequantized GGUF weights are cached as safetensors
(per dtype) so that a second start skips the dequantization.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from swaserve.checkpoint.gguf_config import check_tensor_types
from swaserve.checkpoint.gguf_meta import ggml_type_name
from swaserve.checkpoint.source import ModelLoadError, ModelSource
from swaserve.models.gguf import unpermute_rows
from swaserve.models.registry import gguf_family

log = logging.getLogger("swaserve")


# -- weights ---------------------------------------------------------------------------------

def _gguf_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises many kinds on a bad file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _progress(iterable, total: int, desc: str):
    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr,
                disable=os.environ.get("SWASERVE_NO_PROGRESS") == "1", leave=False)


def _dequantized(source: ModelSource) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in the GGUF's row-major shape) for every tensor, of every
    part of a split GGUF."""
    import gguf

    tensors = [(path, t) for path in source.gguf_files for t in _gguf_reader(path).tensors]
    try:
        check_tensor_types({t.name: int(t.tensor_type) for _, t in tensors})
    except ValueError as e:
        raise ModelLoadError(f"{source.path}: {e}") from e
    for path, t in _progress(tensors, len(tensors), "Dequantizing GGUF"):
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001 - corrupt or unsupported block data
            raise ModelLoadError(f"{path}: cannot dequantize {t.name} "
                                 f"({ggml_type_name(int(t.tensor_type))}): {e}") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        yield t.name, arr if arr.flags.writeable else arr.copy()  # F32 data is the file's


def _iter_gguf(source: ModelSource, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for the GGUF's tensors, in HF's layout (the family's
    gguf.py)."""
    arch = source.gguf_meta["general.architecture"]
    try:
        tensors = gguf_family(arch).tensors_from_gguf(arch, source.hf_config,
                                                      _dequantized(source))
        for name, arr in tensors:
            yield name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    except ValueError as e:
        raise ModelLoadError(f"{source.path}: {e}") from e


# a part of a tensor to read instead of all of it: (name, shape) -> the index, or None
Part = Callable[[str, tuple[int, ...]], tuple[slice, ...] | None]


def _read(st, key: str, dtype: torch.dtype, part: Part | None) -> torch.Tensor:
    """One tensor of an open safetensors file; with `part`, only the bytes of its slice
    are read from the memory-mapped file."""
    if part is not None:
        view = st.get_slice(key)
        index = part(key, tuple(view.get_shape()))
        if index is not None:
            return _cast(view[index], dtype)
    return _cast(st.get_tensor(key), dtype)


def _iter_safetensors(directory: Path, dtype: torch.dtype, part: Part | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = list(st.keys())
                for k in _progress(keys, len(keys), f"Loading {f.name}"):
                    yield k, _read(st, k, dtype, part)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from e


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating tensors to the model dtype; packed integer data (MXFP4 blocks) as stored."""
    return t.to(dtype) if t.is_floating_point() else t


def iter_weights(source: ModelSource, dtype: torch.dtype, part: Part | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every weight; GGUF goes through the weight cache.
    `part` reads only a slice of the tensors it names (a tensor-parallel rank's), from the
    memory-mapped safetensors (the GGUF's cache too); a first GGUF load dequantizes
    whole tensors and cuts them."""
    if source.fmt == "hf":
        yield from _iter_safetensors(source.path, dtype, part)
        return
    cached = source.cache_dir() / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    if cached.exists() and _readable_safetensors(cached):
        yield from _iter_safetensors_file(cached, dtype, part)
        return
    tensors = dict(_iter_gguf(source, dtype))
    try:
        from safetensors.torch import save_file

        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, cached)
    except OSError as e:
        log.warning("could not write weight cache %s: %s", cached, e)
    for name, t in tensors.items():
        index = part(name, tuple(t.shape)) if part is not None else None
        yield name, t if index is None else t[index]


def _readable_safetensors(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as st:
            return len(list(st.keys())) > 0
    except Exception:  # noqa: BLE001 - a torn cache file is rebuilt, never fatal
        log.warning("weight cache %s is unreadable; rebuilding it", path)
        return False


def _iter_safetensors_file(path: Path, dtype: torch.dtype, part: Part | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as st:
            keys = list(st.keys())
            for k in keys:
                yield k, _read(st, k, dtype, part)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: {e}") from e


# -- int8 weights ---------------------------------------------------------------------------

GGML_Q8_0, GGML_Q5_0, GGML_Q4_K, GGML_Q6_K = 8, 6, 12, 14
# (values a block, bytes a block)
_BLOCKS = {GGML_Q8_0: (32, 34), GGML_Q5_0: (32, 22), GGML_Q4_K: (256, 144),
           GGML_Q6_K: (256, 210)}


class _Q8Reader:
    """GGUF tensors stored as Q8_0, Q5_0, Q4_K or Q6_K, read as int8 + scales (+ offsets)
    straight from the memory-mapped file (no float dequantization; a split GGUF's part
    that holds the tensor); Llama's q/k rows are put back in HF's order (a block never
    spans rows, so rows move whole)."""

    def __init__(self, source: ModelSource):
        from swaserve.checkpoint.gguf_meta import read_gguf_tensor_infos

        self.source = source
        self.arch = source.gguf_meta["general.architecture"]
        self.family = gguf_family(self.arch)
        # name -> (dims, GGML type, the file, the offset of its data in the file)
        self.infos: dict[str, tuple[tuple[int, ...], int, Path, int]] = {}
        for path in source.gguf_files:
            infos, data_start = read_gguf_tensor_infos(path)
            for name, (dims, ggml_type, offset) in infos.items():
                self.infos[name] = (dims, ggml_type, path, data_start + offset)

    def get(self, name: str):
        from swaserve.kernels.q8_weight import Q8Weight

        if name not in self.infos:
            return None
        dims, ggml_type, path, offset = self.infos[name]
        if ggml_type not in _BLOCKS or len(dims) != 2 or dims[0] % _BLOCKS[ggml_type][0]:
            return None
        k, n = dims
        values, size = _BLOCKS[ggml_type]
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset,
                        shape=(n * (k // values) * size,))
        heads = self.family.permuted_heads(self.arch, name, self.source.hf_config)
        if heads is not None:
            raw = raw.reshape(n, -1)[unpermute_rows(n, heads)].reshape(-1)
        read = {GGML_Q8_0: Q8Weight.from_q8_0_blocks, GGML_Q5_0: Q8Weight.from_q5_0_blocks,
                GGML_Q4_K: Q8Weight.from_q4_k_blocks, GGML_Q6_K: Q8Weight.from_q6_k_blocks}
        return read[ggml_type](raw, n, k)

    def stacked(self, names: list[str]):
        from swaserve.kernels.q8_weight import Q8Weight

        parts = [self.get(n) for n in names]
        return None if any(p is None for p in parts) else Q8Weight.stack(parts)


def load_q8_weights(source: ModelSource, num_layers: int):
    """int8 copies of the weights the GGUF stores as Q8_0 / Q5_0 / Q4_K / Q6_K (exact): the
    LM head (tied to the embedding when there is no output.weight) under "lm_head", and per
    layer "qkv" and "gate_up" when all their parts are, "o" and "down". {} for other
    sources."""
    if source.fmt != "gguf":
        return {}
    r = _Q8Reader(source)
    out = {"lm_head": r.get("output.weight" if "output.weight" in r.infos else "token_embd.weight")}
    for i in range(num_layers):
        out[f"{i}.qkv"] = r.stacked([f"blk.{i}.attn_{x}.weight" for x in ("q", "k", "v")])
        out[f"{i}.gate_up"] = r.stacked([f"blk.{i}.ffn_{x}.weight" for x in ("gate", "up")])
        out[f"{i}.o"] = r.get(f"blk.{i}.attn_output.weight")
        out[f"{i}.down"] = r.get(f"blk.{i}.ffn_down.weight")
    return {k: v for k, v in out.items() if v is not None}
