"""A model family's seam: what generic code may ask a family, and nothing else.

A family is one package, `models/<family>/`: its typed config (HF and GGUF fields to one
frozen dataclass, defaults and refusals by field), its GGUF metadata and tensor map, its
network, whether it splits over tensor-parallel ranks and which backends run it. Its
`__init__.py` holds one `Family` object, which models/registry.py lists; models/networks.py
maps its architectures to its network. Generic code reaches a family only through those two
(or the typed config it built, `ModelConfig.spec`), never by its name.

The family object does not import its network: ModelConfig (which the networks import)
finds the family through the registry, so the config side and the network side stay two
layers of one package with no import circle.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

Tensors = Iterable[tuple[str, "np.ndarray"]]


class MLXLayer(enum.Enum):
    """The layer forms the MLX backend (mlx/model.py) implements."""

    PRE_NORM_SWIGLU = "pre_norm_swiglu"  # norm, attention, norm, SwiGLU MLP
    SANDWICH_GEGLU = "sandwich_geglu"  # norms before and after attention and a GeGLU MLP
    SINKS_MOE = "sinks_moe"  # attention with sinks, routed clamped-SwiGLU experts


@dataclass(frozen=True)
class FamilyConfig:
    """A config dict as a family reads it: `hf` with its defaults filled in (kept as
    `ModelConfig.raw`), the ModelConfig fields the family sets itself (per-layer shapes,
    KV sources, compressed layers), and its typed config (`ModelConfig.spec`)."""

    hf: dict[str, Any]
    fields: dict[str, Any] = field(default_factory=dict)
    spec: Any = None


@dataclass(frozen=True)
class Cut:
    """One tensor-parallel rank's part of a tensor: `length` entries from `start` along
    `dim`, padded with zeros to `length` where the tensor ends first (the vocabulary); or
    all zeros."""

    dim: int = 0
    start: int = 0
    length: int = 0
    zeros: bool = False

    def of(self, shape: tuple[int, ...], whole: int) -> Cut | None:
        """The cut of a tensor `whole` long along its dim; None for a tensor that is
        already a rank's slice (every cut is shorter than the whole, so cutting twice is
        cutting once)."""
        return self if len(shape) > self.dim and shape[self.dim] == whole else None


class Shapes(Protocol):
    """The ModelConfig fields a family's tensor-parallel checks and cuts read (named here by
    shape: models/config.py imports this module, so this one cannot import it back)."""

    architecture: str
    num_heads: int
    intermediate_size: int


class Family(Protocol):
    """What generic code asks a model family (its network: models/networks.py)."""

    name: str
    # HF architecture names it runs -> the name it runs them as (a multimodal wrapper's
    # text model)
    architectures: Mapping[str, str]
    # GGUF `general.architecture` values it reads -> the HF architecture they run as
    gguf_architectures: Mapping[str, str]
    # the MLX backend's form of its layers; None: torch only (its network's `runs_on_mlx`
    # says the same, tests/models/test_families.py holds them equal)
    mlx_layer: MLXLayer | None

    def claims(self, hf: dict[str, Any]) -> bool:
        """Whether the config dict is this family's (by architecture or model_type)."""
        ...

    def architecture(self, hf: dict[str, Any]) -> str:
        """The architecture a config runs as (its text model's; one from the model_type
        where it names none)."""
        ...

    def text_config(self, outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
        """A multimodal checkpoint's text config (`inner`: its text_config with the outer
        architectures), with whatever the family takes from the wrapper."""
        ...

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        """The family's defaults, refusals, per-layer fields and typed config; ValueError
        names a field it does not implement."""
        ...

    def check_tensor_parallel(self, cfg: Shapes, size: int) -> None:
        """ValueError when the family does not split over `size` ranks."""
        ...

    def tensor_cut(self, name: str, shape: tuple[int, ...], cfg: Shapes, rank: int,
                   size: int) -> Cut | None:
        """Rank `rank`'s cut of one of the family's own tensors (HF-named, of the whole
        model `cfg`), beyond the generic attention, MLP and vocabulary cuts; None: whole."""
        ...

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        """An HF config dict from a GGUF's metadata (gguf_meta's, with its tensor types)."""
        ...

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in HF's layout) for dequantized GGUF tensors."""
        ...

    def permuted_heads(self, arch: str, name: str, hf: dict[str, Any]) -> int | None:
        """How many heads llama.cpp permuted a GGUF tensor's rows over, or None."""
        ...


class GGUFMap(Protocol):
    """A family's gguf.py: the GGUF architectures it reads and how."""

    ARCHITECTURES: Mapping[str, str]

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]: ...

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]: ...


class FamilyBase:
    """A family's defaults: claimed by its architecture names, no config of its own, no
    tensor parallelism refused beyond the generic checks, GGUF read through its
    `gguf_map` (None: no GGUF). A family subclasses it and overrides what differs."""

    name = ""
    architectures: Mapping[str, str] = {}
    gguf_map: GGUFMap | None = None  # the family's gguf.py
    mlx_layer: MLXLayer | None = None
    # why the family runs on one rank only; None: it splits as the generic checks allow
    one_rank_only: str | None = None
    model_types: tuple[str, ...] = ()  # model_type prefixes it claims without an architecture

    def claims(self, hf: dict[str, Any]) -> bool:
        archs = hf.get("architectures") or []
        if archs and archs[0] in self.architectures:
            return True
        return any(str(hf.get("model_type", "")).startswith(t) for t in self.model_types)

    def architecture(self, hf: dict[str, Any]) -> str:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else hf.get("model_type", "?")
        return self.architectures.get(arch, arch)

    def text_config(self, outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
        return inner

    def read_config(self, hf: dict[str, Any]) -> FamilyConfig:
        return FamilyConfig(hf)

    def check_tensor_parallel(self, cfg: Shapes, size: int) -> None:
        if self.one_rank_only is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture} "
                             f"({self.one_rank_only}) runs on one rank only")

    def tensor_cut(self, name: str, shape: tuple[int, ...], cfg: Shapes, rank: int,
                   size: int) -> Cut | None:
        return None

    @property
    def gguf_architectures(self) -> Mapping[str, str]:
        return self.gguf_map.ARCHITECTURES if self.gguf_map is not None else {}

    def config_from_gguf(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        return self._gguf(arch).config_from_gguf(meta, arch)

    def tensors_from_gguf(self, arch: str, hf: dict[str, Any], tensors: Tensors
                          ) -> Iterator[tuple[str, np.ndarray]]:
        return self._gguf(arch).tensors_from_gguf(arch, hf, tensors)

    def permuted_heads(self, arch: str, name: str, hf: dict[str, Any]) -> int | None:
        permuted = getattr(self._gguf(arch), "permuted_heads", None)  # Llama's q/k rows
        return permuted(arch, name, hf) if permuted is not None else None

    def _gguf(self, arch: str) -> GGUFMap:
        if self.gguf_map is None or arch not in self.gguf_map.ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported")
        return self.gguf_map


class Plain(FamilyBase):
    """A config no family claims: read with the generic fields only; models/networks.py
    refuses its architecture when the engine loads it."""

    name = "plain"
