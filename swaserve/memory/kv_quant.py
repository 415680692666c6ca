"""The stored form of K and V (`EngineConfig.kv_cache_dtype`): the compute dtype as it is
("auto"), or 8-bit values with a float32 scale per block of `BLOCK` values of each (slot,
KV head) beside them (one block a head whose size `BLOCK` does not divide).

int8 stores `round(x / s)` in [-127, 127] with `s = max|x| / 127` over the block (llama.cpp's
q8_0 layout, with a float32 scale); fp8_e4m3 stores `x / s` as torch.float8_e4m3fn with
`s = max|x| / 448`: a scale keeps each block's largest value at e4m3's top and its small
values out of the subnormals, where an unscaled cast would lose both. A block of zeros has
scale 0 and reads back as zeros. Blocks rather than one scale a head: a head's few large
values would set a step too coarse for the rest (benchmarks/README.md).

`KVBuffers` is one pool's buffers in a format (full pool, window rings, window pages); every
reader of a quantized pool sees `dequantize(values, scales)`, and the layer's own K/V of the
step are replaced by the same round trip before they are attended to, so a chunked prefill
and a one-shot one read the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32
BLOCK = 32  # values a scale covers


def scale_blocks(head_dim: int) -> int:
    """Scales a (slot, KV head) has: blocks of BLOCK, or one for the whole head."""
    return head_dim // BLOCK if head_dim % BLOCK == 0 else 1


@dataclass(frozen=True)
class KVFormat:
    """How a pool stores K and V: `values` dtype, and whether scales (per block of a slot's
    KV head) sit beside them."""

    name: str
    values: torch.dtype
    quantized: bool
    qmax: float = 0.0  # the largest stored magnitude (the scale maps max|x| onto it)

    @property
    def value_bytes(self) -> int:
        return torch.empty((), dtype=self.values).element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (`scale_blocks(head_dim)` of them a slot and KV head)."""
        return torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quantized else 0


# the 8-bit formats by `kv_cache_dtype` name ("auto" is the compute dtype's); the names a
# user may give are config.KV_CACHE_DTYPES, checked there
QUANTIZED = {
    "int8": KVFormat("int8", torch.int8, True, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, True, 448.0),
}


def kv_format(kv_cache_dtype: str, dtype: torch.dtype) -> KVFormat:
    """The format a validated `kv_cache_dtype` names for a model computing in `dtype`."""
    if kv_cache_dtype == "auto":
        return KVFormat(str(dtype).removeprefix("torch."), dtype, False)
    return QUANTIZED[kv_cache_dtype]


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in `fmt.values`, scales [..., scale_blocks(D)] float32)."""
    xf = x.to(torch.float32).unflatten(-1, (scale_blocks(x.shape[-1]), -1))
    scale = xf.abs().amax(dim=-1) / fmt.qmax
    y = xf / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    if fmt.values == torch.int8:
        return y.round_().clamp_(-127, 127).flatten(-2).to(torch.int8), scale
    return y.clamp_(-fmt.qmax, fmt.qmax).flatten(-2).to(fmt.values), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype` (float32 products, rounded once)."""
    v = values.to(torch.float32).unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]
    return v.flatten(-2).to(dtype)


def round_trip(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """What a pool in `fmt` gives back for `x`."""
    return x if not fmt.quantized else dequantize(*quantize(x, fmt), x.dtype)


class KVBuffers:
    """One pool's K and V buffers, a pair per layer of shape [slots, KV heads, head_dim] in
    the format's dtype; when quantized, `k_scale` / `v_scale` [slots, KV heads, blocks]
    beside them (empty lists otherwise). Every buffer is indexed by slot in dim 0, so a copy of slots
    moves values and scales alike (`buffers`)."""

    def __init__(self, shapes: list[tuple[int, int, int]], fmt: KVFormat,
                 device: torch.device | str, shared: list[bool] | None = None):
        """`shared[i]`: layer i's V is its K (DeepSeek-V4's K = V branch), one buffer."""
        shared = shared or [False] * len(shapes)
        self.kv_format = fmt
        self.k = [torch.zeros(s, dtype=fmt.values, device=device) for s in shapes]
        self.v = [k if one else torch.zeros_like(k) for k, one in zip(self.k, shared)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if fmt.quantized:
            self.k_scale = [torch.zeros(*s[:2], scale_blocks(s[2]), dtype=SCALE_DTYPE,
                                        device=device) for s in shapes]
            self.v_scale = [k if one else torch.zeros_like(k)
                            for k, one in zip(self.k_scale, shared)]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer once, values then scales, in a fixed order (pools of one kind match);
        fp8 values as their bytes (torch's CPU index ops do not take float8)."""
        out: list[torch.Tensor] = []
        for t in self.k + self.v + self.k_scale + self.v_scale:
            if not any(t is u for u in out):
                out.append(t)
        return [_bytes(t) for t in out]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def write(self, dense_layer: int, slots: torch.Tensor, k: torch.Tensor | StoredKV,
              v: torch.Tensor | StoredKV) -> None:
        """K/V rows at `slots`: tensors of an unquantized pool, `StoredKV` of a quantized one."""
        if self.kv_format.quantized:
            _bytes(self.k[dense_layer]).index_copy_(0, slots, _bytes(k.values))
            _bytes(self.v[dense_layer]).index_copy_(0, slots, _bytes(v.values))
            self.k_scale[dense_layer].index_copy_(0, slots, k.scales)
            self.v_scale[dense_layer].index_copy_(0, slots, v.scales)
        else:
            self.k[dense_layer].index_copy_(0, slots, k)
            self.v[dense_layer].index_copy_(0, slots, v)

    def read(self, dense_layer: int, select, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`select(buffer)` of the layer's K and V (a gather or a view by slot), in `dtype`."""
        if not self.kv_format.quantized:
            return select(self.k[dense_layer]), select(self.v[dense_layer])
        values = self.kv_format.values
        k = select(_bytes(self.k[dense_layer])).view(values)
        v = select(_bytes(self.v[dense_layer])).view(values)
        return (dequantize(k, select(self.k_scale[dense_layer]), dtype),
                dequantize(v, select(self.v_scale[dense_layer]), dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 values seen as uint8 (same storage): what CPU gathers and copies take."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@dataclass(frozen=True)
class StoredKV:
    """Rows as a quantized pool stores them."""

    values: torch.Tensor
    scales: torch.Tensor

    def __getitem__(self, idx) -> StoredKV:
        return StoredKV(self.values[idx], self.scales[idx])

    @classmethod
    def of(cls, x: torch.Tensor, fmt: KVFormat) -> StoredKV:
        return cls(*quantize(x, fmt))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.values, self.scales, dtype)
