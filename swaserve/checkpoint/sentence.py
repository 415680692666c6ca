"""A sentence-transformers checkpoint's modules beside the transformer (modules.json): its
pooling (1_Pooling/config.json), its dense projections (2_Dense/, 3_Dense/: config.json and
model.safetensors) and whether it normalizes, read so that the engine pools and projects a
prompt's hidden states as `SentenceTransformer(dir).encode` does."""

from __future__ import annotations

import json
from pathlib import Path

from swaserve.checkpoint.source import ModelLoadError
from swaserve.models.encoder import DenseLayer, SentenceModules

# sentence-transformers' Pooling flags -> swaserve's pooling names; the modes it has beside
# these (max, mean of sqrt length, weighted mean) are refused by name
POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_lasttoken": "last"}
ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
               "torch.nn.modules.activation.Tanh": "tanh"}


def read_sentence_modules(directory: Path) -> SentenceModules | None:
    """The modules listed in `directory`/modules.json after the transformer, or None where
    there is no modules.json. Raises ModelLoadError naming a module swaserve cannot run."""
    listing = directory / "modules.json"
    if not listing.is_file():
        return None
    try:
        modules = json.loads(listing.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{listing}: cannot read: {e}") from e
    pooling, dense, normalize = None, [], False
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        folder = directory / str(m.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling(_config(folder))
        elif kind == "Dense":
            dense.append(_dense(folder))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{listing}: module {kind!r} is not supported (Transformer, "
                                 "Pooling, Dense, Normalize)")
    return SentenceModules(pooling, dense, normalize)


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: cannot read: {e}") from e


def _pooling(cfg: dict) -> str:
    modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in POOLING_FLAGS:
        raise ModelLoadError(f"Pooling: {modes or 'no mode'} is not supported (one of "
                             f"{', '.join(POOLING_FLAGS)})")
    if cfg.get("include_prompt", True) is False:
        raise ModelLoadError("Pooling: include_prompt false is not supported")
    return POOLING_FLAGS[modes[0]]


def _dense(folder: Path) -> DenseLayer:
    from safetensors.torch import load_file

    cfg = _config(folder)
    activation = ACTIVATIONS.get(cfg.get("activation_function",
                                         "torch.nn.modules.linear.Identity"))
    if activation is None:
        raise ModelLoadError(f"{folder}: activation {cfg['activation_function']!r} is not "
                             f"supported ({', '.join(ACTIVATIONS)})")
    path = folder / "model.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no model.safetensors")
    tensors = load_file(str(path))
    weight = tensors.get("linear.weight")
    shape = (cfg.get("out_features"), cfg.get("in_features"))
    if weight is None or tuple(weight.shape) != shape:
        raise ModelLoadError(f"{path}: linear.weight missing or not of shape {shape}")
    bias = tensors.get("linear.bias") if cfg.get("bias", True) else None
    return DenseLayer(weight.float(), None if bias is None else bias.float(), activation)
