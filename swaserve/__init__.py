"""swaserve: an inference and serving engine for hybrid sliding-window-attention models."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]

_LAZY = {"LLM": "swaserve.entrypoints.llm", "RequestOutput": "swaserve.entrypoints.llm",
         "CompletionOutput": "swaserve.entrypoints.llm", "SamplingParams": "swaserve.sampling.params",
         "EngineConfig": "swaserve.config"}

if TYPE_CHECKING:
    from swaserve.config import EngineConfig
    from swaserve.entrypoints.llm import LLM, CompletionOutput, RequestOutput
    from swaserve.sampling.params import SamplingParams


def __getattr__(name: str):
    # torch is imported only when the engine is, so `swaserve plan` starts fast
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swaserve' has no attribute {name!r}")
