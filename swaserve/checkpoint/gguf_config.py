"""GGUF metadata as an HF config dict, so that ModelConfig.from_hf reads both formats: the
GGUF architecture's family (models/registry.py) reads the keys llama.cpp's converter writes
and adds what the file leaves out (its fixed design); tensor types swaserve cannot read are
refused first."""

from __future__ import annotations

from typing import Any

from swaserve.checkpoint.gguf_meta import GGML_READABLE, GGML_TYPE_NAMES, ggml_type_name
from swaserve.models.registry import gguf_family


def gguf_metadata_to_hf(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF-style config dict from GGUF key/values (gguf_meta.read_gguf_metadata's, with
    its tensor types); a ValueError names what swaserve cannot run (the architecture, a
    tensor's type)."""
    arch = meta.get("general.architecture")
    family = gguf_family(arch)
    check_tensor_types(meta.get("GGUF.tensor_types", {}))
    return family.config_from_gguf(meta, arch)


def check_tensor_types(types: dict[str, int]) -> None:
    """A ValueError naming the first tensor of a type swaserve cannot read."""
    for name, ggml_type in types.items():
        if ggml_type not in GGML_READABLE:
            readable = ", ".join(GGML_TYPE_NAMES[t] for t in sorted(GGML_READABLE))
            raise ValueError(f"GGUF tensor {name!r} has type {ggml_type_name(ggml_type)}, "
                             f"which swaserve cannot read (readable: {readable})")
