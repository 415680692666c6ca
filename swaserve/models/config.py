"""ModelConfig: the architecture facts a model family needs, read from an HF config.json dict
or from GGUF metadata (converted to the same dict first by the family's gguf.py, so both
paths share one parser). The generic fields are read here; the family (models/registry.py)
fills in its defaults, refuses what it does not implement, sets its per-layer fields and
builds its typed config (`spec`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from swaserve.memory.layout import CacheLayout, CompressSpec, LayerKind, LayerSpec
from swaserve.models.family import Family
from swaserve.models.registry import family_of


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]  # "full" | "sliding" | "linear" (Gated DeltaNet) per layer
    max_position_embeddings: int
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)  # full layers
    rope_local_scaling: dict[str, Any] | None = field(default=None, compare=False)  # sliding
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # per layer, where layers differ (Gemma 4); empty: every layer has the shapes above
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int | None, ...] = ()  # the layer whose KV a layer reuses (None: own)
    # every layer attends both ways (EmbeddingGemma): an encoder, which embeds and does not
    # generate; a sliding layer then sees the keys within sliding_window // 2 either side
    bidirectional: bool = False
    # DeepSeek-V4: per layer (compress rate, overlapping windows, indexer head size); empty
    # for other families, rate 0 for a layer without compressed entries
    layer_compress: tuple[tuple[int, bool, int], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the family the config belongs to, and its typed config (the family's config.py; None
    # for a family without fields of its own)
    family: Family | None = field(default=None, compare=False, repr=False)
    spec: Any = field(default=None, compare=False, repr=False)

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(scalar)

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_source_of(self, layer: int) -> int | None:
        return self.kv_sources[layer] if self.kv_sources else None

    def kind_head_dim(self, sliding: bool) -> int:
        """The head size of the layers of one kind (the size its RoPE table has)."""
        kind = "sliding" if sliding else "full"
        return next((self.head_dim_of(i) for i, t in enumerate(self.layer_types) if t == kind),
                    self.head_dim)

    @property
    def uniform_attention(self) -> bool:
        """Every layer has the same attention shape and stores its own KV."""
        return (len(set(self.layer_head_dims)) <= 1 and len(set(self.layer_kv_heads)) <= 1
                and not any(s is not None for s in self.kv_sources))

    def cache_layout(self, drafts: int = 0) -> CacheLayout:
        """The layers' cache needs; `drafts`: the draft tokens a step may write (speculative
        decoding), which compressed layers' rings make room for."""
        specs = []
        for i, kind in enumerate(self.layer_types):
            if kind == "linear":  # a recurrent state per request, no KV
                conv, state = self.spec.state_shapes()
                specs.append(LayerSpec(LayerKind.RECURRENT, 0, 0, conv_state=conv,
                                       recurrent_state=state))
                continue
            sliding = kind == "sliding"
            specs.append(LayerSpec(LayerKind.SLIDING if sliding else LayerKind.FULL,
                                   self.kv_heads_of(i), self.head_dim_of(i),
                                   window=self.sliding_window if sliding else None,
                                   kv_source=self.kv_source_of(i),
                                   compress=self._compress_spec(i, drafts),
                                   kv_shared=bool(self.layer_compress)))
        return CacheLayout(tuple(specs))

    def _compress_spec(self, layer: int, drafts: int) -> CompressSpec | None:
        if not self.layer_compress or not self.layer_compress[layer][0]:
            return None
        rate, overlap, index_dim = self.layer_compress[layer]
        return CompressSpec(rate, self.head_dim_of(layer), overlap, index_dim, drafts)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        if "text_config" in cfg:  # multimodal wrapper: serve its text model
            outer = cfg
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
            cfg = family_of(cfg).text_config(outer, cfg)
        family = family_of(cfg)
        read = family.read_config(cfg)
        cfg = read.hf
        n = int(cfg["num_hidden_layers"])
        layer_types, window = _layer_types(cfg, n)
        rope = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=family.architecture(cfg),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_local_theta=rope.local_theta,
            layer_types=layer_types,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            sliding_window=int(window) if window and "sliding" in layer_types else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            rope_scaling=rope.scaling,
            rope_local_scaling=rope.local_scaling,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            **read.fields,
            bidirectional=bool(cfg.get("use_bidirectional_attention", False)),
            raw=dict(cfg),
            family=family,
            spec=read.spec,
        )


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[tuple[str, ...], int | None]:
    """("full" | "sliding" | "linear" per layer, the window), from layer_types, a sliding
    window pattern, or one kind for all layers."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2/3 carry a window they do not use
        window = None
    types = cfg.get("layer_types")
    if types is not None and window is None:
        types = ["full_attention" if t != "linear_attention" else t for t in types]
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if window and pattern:
            types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                     for i in range(n)]
        else:
            types = ["sliding_attention" if window else "full_attention"] * n
    kinds = {"sliding_attention": "sliding", "linear_attention": "linear"}
    return tuple(kinds.get(t, "full") for t in types), window


class _Rope(NamedTuple):
    theta: float
    local_theta: float
    scaling: dict[str, Any] | None  # None: unscaled
    local_scaling: dict[str, Any] | None


def _rope(cfg: dict[str, Any]) -> _Rope:
    """RoPE of full and sliding layers: per kind (Gemma 3's rope_parameters), or one for
    both (older Gemma 3 configs: an unscaled local base frequency of its own)."""
    rope = cfg.get("rope_parameters") or {}

    def scaled(section: dict) -> dict | None:
        kind = section.get("rope_type") or section.get("type") or "default"
        return section if kind != "default" else None

    if "full_attention" in rope:  # per-kind RoPE (Gemma 3)
        full_rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
        theta = float(full_rope.get("rope_theta", 10000.0))
        return _Rope(theta, float(local_rope.get("rope_theta", theta)), scaled(full_rope),
                     scaled(local_rope))
    full_rope = rope or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = scaled(full_rope)
    if "rope_local_base_freq" in cfg:  # older Gemma 3 configs: unscaled local RoPE
        return _Rope(theta, float(cfg["rope_local_base_freq"]), scaling, None)
    return _Rope(theta, theta, scaling, scaling)
