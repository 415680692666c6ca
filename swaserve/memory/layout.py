"""CacheLayout: which attention layers keep full history and which keep a window.

Full layers get a dense index into the full pool and sliding layers a dense index into the
window pool, so that a sliding layer between two full ones never shifts a full layer's slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if (self.kind is LayerKind.SLIDING) != (self.window is not None):
            raise ValueError("a sliding layer needs a window and a full layer must not have one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerSpec, ...]

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s.kind is LayerKind.FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s.kind is LayerKind.SLIDING)

    def dense_index(self, layer: int) -> int:
        """Index of `layer` among the layers of its own kind (its buffer in that kind's pool)."""
        kind = self.layers[layer].kind
        return sum(1 for s in self.layers[:layer] if s.kind is kind)

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
