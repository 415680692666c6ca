"""A model loaded from its checkpoint for a config: built on the meta device, filled from
the checkpoint's tensors (one rank's slices under tensor parallelism), with the int8 weights
the CPU decode kernels multiply. The engine and each tensor-parallel rank load through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.checkpoint.shard import local_config, sharded_weights
from swaserve.checkpoint.source import ModelLoadError, ModelSource, resolve_model
from swaserve.checkpoint.tokenizer import Tokenizer, load_tokenizer
from swaserve.checkpoint.weights import iter_weights, load_q8_weights
from swaserve.config import EngineConfig, cache_root
from swaserve.kernels import build, q8
from swaserve.models.config import ModelConfig
from swaserve.models.networks import model_class


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    max_model_len: int
    tokenizer: Tokenizer | None
    model: torch.nn.Module


def load_model(config: EngineConfig, dtype: torch.dtype, device: torch.device,
               tp=None) -> LoadedModel:
    """The model (one rank's shard of it under `tp`, a distributed.group.TPGroup), its
    config (the whole model's: the shard's shapes are `model.cfg`), tokenizer and context
    length. The kernels the model calls build into the swaserve cache's kernels/."""
    build.use_cache_dir(cache_root() / "kernels")
    source = resolve_model(config.model, config.revision)
    cfg = source.model_config()
    model_class(cfg.architecture)  # unsupported architectures fail before any loading
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context "
                         f"length {cfg.max_position_embeddings}")
    tokenizer = load_tokenizer(source)
    try:
        model = build_model(source, cfg, dtype, device, tp)
    except ModelLoadError:
        raise
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{source.path}: cannot load weights: {e}") from e
    if (config.int8_weights and dtype != torch.float32 and device.type == "cpu"
            and not config.batch_invariant and q8.available() and tp is None):
        # float32 stays the plain reference path; batch-invariant mode needs one kernel
        # for every row count; the int8 copies are of whole weights, not a rank's slices
        fast = {name: w.for_activations(dtype)
                for name, w in load_q8_weights(source, cfg.num_layers).items()}
        model.use_q8({name: w for name, w in fast.items() if w is not None},
                     head_screen=config.head_screen,
                     int8_activations=config.int8_activations)
    return LoadedModel(source, cfg, max_model_len, tokenizer, model)


def build_model(source: ModelSource, cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device, tp=None) -> torch.nn.Module:
    """Build on the meta device, then fill the parameters from the checkpoint; under tensor
    parallelism (`tp`: the rank's distributed.group.TPGroup) at this rank's shapes, from
    this rank's slices (checkpoint/shard.py)."""
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg if tp is None else local_config(cfg, tp.size))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not name.endswith("norm"):  # norm multipliers stay float32
                setattr(module, name, torch.nn.Parameter(
                    torch.empty_like(p, dtype=dtype), requires_grad=False))
            else:
                p.requires_grad_(False)
    model.to_empty(device=device)
    if tp is None:
        model.load_weights(iter_weights(source, dtype))
    else:
        model.load_weights(sharded_weights(source, dtype, cfg, tp.rank, tp.size,
                                           cls.dense_weights))
        model.set_tensor_parallel(tp)
    return model.eval()
