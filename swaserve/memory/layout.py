"""CacheLayout: which attention layers keep full history and which keep a window, and
which layers store no KV of their own but read another layer's (Gemma 4's KV sharing).

Full layers get a dense index into the full pool and sliding layers a dense index into the
window pool, so that a sliding layer between two full ones never shifts a full layer's slot.
Each layer has its own shape (KV heads, head size), so pools and rings are sized per layer.
A reusing layer (`kv_source` set) has no buffer: its dense index is its source's, so it reads
the source's ring or pages through the same slot addresses in the same step.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from swaserve.memory.kv_quant import scale_blocks


class LayerKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache needs."""

    kind: LayerKind
    num_kv_heads: int
    head_dim: int
    window: int | None = None  # only for SLIDING
    fixed_state_bytes: int = 0  # per-request state beside the KV (e.g. a compression ring)
    kv_source: int | None = None  # the earlier layer whose KV this one reads (stores none)

    def __post_init__(self) -> None:
        if (self.kind is LayerKind.SLIDING) != (self.window is not None):
            raise ValueError("a sliding layer needs a window and a full layer must not have one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V of one token: `dtype_bytes` a value, and `scale_bytes` a scale when the KV
        is quantized (memory/kv_quant.py: a scale per block of a head's values)."""
        scales = scale_blocks(self.head_dim) * scale_bytes
        return 2 * self.num_kv_heads * (self.head_dim * dtype_bytes + scales)

    @property
    def stores_kv(self) -> bool:
        return self.kv_source is None


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        for i, s in enumerate(self.layers):
            if s.kv_source is None:
                continue
            if not 0 <= s.kv_source < i:
                raise ValueError(f"layer {i}: kv_source {s.kv_source} is not an earlier layer")
            src = self.layers[s.kv_source]
            if (not src.stores_kv or src.kind is not s.kind or src.window != s.window
                    or (src.num_kv_heads, src.head_dim) != (s.num_kv_heads, s.head_dim)):
                raise ValueError(f"layer {i}: kv_source {s.kv_source} is not a storing layer "
                                 "of the same kind and shape")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Full layers that store KV (one full-pool buffer each)."""
        return tuple(i for i, s in enumerate(self.layers)
                     if s.kind is LayerKind.FULL and s.stores_kv)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Sliding layers that store KV (one ring buffer each)."""
        return tuple(i for i, s in enumerate(self.layers)
                     if s.kind is LayerKind.SLIDING and s.stores_kv)

    @property
    def reusing_layers(self) -> tuple[int, ...]:
        """Layers that read another layer's KV and store none."""
        return tuple(i for i, s in enumerate(self.layers) if not s.stores_kv)

    def dense_index(self, layer: int) -> int:
        """Index of `layer`'s buffer among the storing layers of its kind (a reusing layer's
        is its source's)."""
        spec = self.layers[layer]
        if spec.kv_source is not None:
            return self.dense_index(spec.kv_source)
        return sum(1 for s in self.layers[:layer] if s.kind is spec.kind and s.stores_kv)

    def without_sharing(self) -> CacheLayout:
        """The same layers, each storing its own KV (what sharing saves is the difference)."""
        return CacheLayout(tuple(dataclasses.replace(s, kv_source=None) for s in self.layers))

    @property
    def max_window(self) -> int:
        return max((s.window for s in self.layers if s.window is not None), default=0)

    def ring_size(self, chunk_size: int, page_size: int) -> int:
        """Slots per request per sliding layer: W + chunk, rounded up to whole pages.

        A chunk of N <= chunk_size new tokens plus the W-1 keys before it always fit, so
        writing a chunk never overwrites a key that one of its own queries still reads. With
        speculative decoding `chunk_size` is the most a step writes per request (a chunk, or
        a decode token and its draft: `EngineConfig.step_tokens`), so the positions a
        rejected draft wrote over are ones no later query reads.
        """
        if not self.sliding_layers:
            return 0
        need = self.max_window + chunk_size
        return -(-need // page_size) * page_size
