"""The model families swaserve runs, and which one a config or a GGUF architecture belongs
to. With models/networks.py (their torch networks), the one place that imports a family
package from outside it."""

from __future__ import annotations

from typing import Any

from swaserve.models import deepseek_v4, gemma3, gemma4, gpt_oss, llama, qwen3_5
from swaserve.models.family import Family, Plain

# the order a config without a known architecture is offered to them (by model_type)
FAMILIES: tuple[Family, ...] = (qwen3_5.FAMILY, gemma4.FAMILY, deepseek_v4.FAMILY,
                                gemma3.FAMILY, gpt_oss.FAMILY, llama.FAMILY)
PLAIN: Family = Plain()


def family_of(hf: dict[str, Any]) -> Family:
    """The family of an HF config dict; the plain one (generic fields only) for a config no
    family claims."""
    return next((f for f in FAMILIES if f.claims(hf)), PLAIN)


def gguf_architectures() -> dict[str, Family]:
    """GGUF `general.architecture` -> its family."""
    return {arch: f for f in FAMILIES for arch in f.gguf_architectures}


def gguf_family(arch: str) -> Family:
    """The family of a GGUF architecture; ValueError names the ones supported."""
    families = gguf_architectures()
    if arch not in families:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(families))})")
    return families[arch]
