"""CacheLayout: which attention layers keep full history and which keep a window, which
layers store no KV of their own but read another layer's (Gemma 4's KV sharing), and which
keep a fixed-size recurrent state instead of KV (Qwen3.5's Gated DeltaNet layers).

Full layers get a dense index into the full pool and sliding layers a dense index into the
window pool, so that a sliding layer between two full ones never shifts a full layer's slot.
Each layer has its own shape (KV heads, head size), so pools and rings are sized per layer.
A reusing layer (`kv_source` set) has no buffer: its dense index is its source's, so it reads
the source's ring or pages through the same slot addresses in the same step.
A recurrent layer keeps no KV at all: per request row, one causal-conv window
(`conv_state`: channels x (kernel - 1), in the model dtype) and one recurrent matrix per head
(`recurrent_state`: heads x d_k x d_v, float32), whatever the context length
(memory/state_pool.py); its dense index counts the recurrent layers.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from swaserve.memory.kv_quant import scale_blocks


@dataclass(frozen=True)
class CompressSpec:
    """A DeepSeek-V4 compressed layer's state beside its sliding K=V branch: one pooled
    entry per `rate` tokens (C4: each pooled over two windows, `overlap`, with the lightning
    indexer's keys of `index_head_dim` beside it; C128: one window). Tokens not yet pooled
    wait in a per-row ring of `span` slots (memory/compress_pool.py)."""

    rate: int
    head_dim: int
    overlap: bool = False
    index_head_dim: int = 0
    drafts: int = 0  # draft tokens a step may write and roll back (speculative decoding)

    @property
    def needed(self) -> int:
        """Raw tokens a row may still need: the open window, with overlap the one before."""
        return self.rate * (2 if self.overlap else 1)

    @property
    def span(self) -> int:
        """Raw-token slots per row: what may be needed, and room for a step's drafts, whose
        writes must not overwrite a needed token if they are rejected."""
        return self.needed + self.drafts

    @property
    def width(self) -> int:
        """Channels of one raw token's kv (and of its gate scores)."""
        return self.head_dim * (2 if self.overlap else 1)

    @property
    def index_width(self) -> int:
        return self.index_head_dim * (2 if self.overlap else 1)

    def ring_bytes(self, dtype_bytes: int) -> int:
        """One row's ring: kv and gate of the compressor and the indexer, int64 positions."""
        return self.span * (2 * (self.width + self.index_width) * dtype_bytes + 8)

    def entry_bytes_per_token(self, dtype_bytes: int) -> int:
        """Entries and indexer keys cost per token (one of each per `rate` tokens)."""
        per_entry = (self.head_dim + self.index_head_dim) * dtype_bytes
        if per_entry % self.rate:
            raise ValueError(f"head_dim: an entry of {per_entry} bytes does not split over "
                             f"{self.rate} tokens")
        return per_entry // self.rate


class LayerKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    RECURRENT = "recurrent"  # a fixed-size state per request (Gated DeltaNet), no KV


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache needs."""

    kind: LayerKind
    num_kv_heads: int
    head_dim: int
    window: int | None = None  # only for SLIDING
    fixed_state_bytes: int = 0  # per-request state beside the KV (e.g. a compression ring)
    kv_source: int | None = None  # the earlier layer whose KV this one reads (stores none)
    # RECURRENT only: (channels, kernel - 1) of the conv window, in the model dtype, and
    # (heads, d_k, d_v) of the recurrent state, in float32
    conv_state: tuple[int, int] | None = None
    recurrent_state: tuple[int, int, int] | None = None
    compress: CompressSpec | None = None  # DeepSeek-V4's compressed entries and their state
    kv_shared: bool = False  # K and V are one tensor (DeepSeek-V4), stored once

    def __post_init__(self) -> None:
        if (self.kind is LayerKind.SLIDING) != (self.window is not None):
            raise ValueError("a sliding layer needs a window and a full layer must not have one")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        recurrent = self.kind is LayerKind.RECURRENT
        if recurrent != (self.conv_state is not None and self.recurrent_state is not None):
            raise ValueError("a recurrent layer needs conv and recurrent state shapes, and "
                             "only a recurrent layer has them")
        if recurrent and self.kv_source is not None:
            raise ValueError("a recurrent layer keeps its own state")

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V of one token (K alone for a K = V layer): `dtype_bytes` a value, and
        `scale_bytes` a scale when the KV is quantized (memory/kv_quant.py: a scale per
        block of a head's values). A recurrent layer stores no KV."""
        if self.kind is LayerKind.RECURRENT:
            return 0
        scales = scale_blocks(self.head_dim) * scale_bytes
        return (1 if self.kv_shared else 2) * self.num_kv_heads * (
            self.head_dim * dtype_bytes + scales)

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of per-request state beside the KV: `fixed_state_bytes`, and a recurrent
        layer's conv window (model dtype) and recurrent matrices (float32)."""
        out = self.fixed_state_bytes
        if self.kind is LayerKind.RECURRENT:
            c, w = self.conv_state
            h, dk, dv = self.recurrent_state
            out += c * w * dtype_bytes + h * dk * dv * 4
        return out

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
    def recurrent_layers(self) -> tuple[int, ...]:
        """Layers that keep a recurrent state per request (one state-pool buffer each)."""
        return tuple(i for i, s in enumerate(self.layers) if s.kind is LayerKind.RECURRENT)

    def state_bytes_per_row(self, dtype_bytes: int) -> int:
        """The recurrent layers' state of one request (conv windows and matrices)."""
        return sum(self.layers[i].state_bytes(dtype_bytes) for i in self.recurrent_layers)

    @property
    def reusing_layers(self) -> tuple[int, ...]:
        """Layers that read another layer's KV and store none."""
        return tuple(i for i, s in enumerate(self.layers) if not s.stores_kv)

    @property
    def paged(self) -> bool:
        """Whether requests take pages (full layers' KV, compressed entries)."""
        return bool(self.full_layers or self.compressed_layers)

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """Layers with compressed entries and a compress state (DeepSeek-V4's C4 / C128)."""
        return tuple(i for i, s in enumerate(self.layers) if s.compress is not None)

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
