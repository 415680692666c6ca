"""An engine's wiring from its config: the model loaded from its checkpoint (with the int8
weights the CPU decode kernels multiply), and the KV plan for its memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.checkpoint.config import ModelConfig
from swaserve.checkpoint.source import ModelLoadError, ModelSource, resolve_model
from swaserve.checkpoint.tokenizer import Tokenizer, load_tokenizer
from swaserve.checkpoint.weights import load_q8_weights
from swaserve.config import DTYPE_BYTES, EngineConfig, cache_root, parse_bytes
from swaserve.distributed.group import TPGroup
from swaserve.engine.runner import build_model
from swaserve.kernels import build, q8
from swaserve.memory.layout import CacheLayout
from swaserve.memory.planner import MemoryPlan, plan_memory
from swaserve.models.registry import model_class

DEFAULT_KV_MEMORY = 1024**3


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    max_model_len: int
    tokenizer: Tokenizer | None
    model: torch.nn.Module


def load_model(config: EngineConfig, dtype: torch.dtype, device: torch.device,
               tp: TPGroup | None = None) -> LoadedModel:
    """The model (one rank's shard of it under `tp`), its config (the whole model's: the
    shard's shapes are `model.cfg`), tokenizer and context length. The kernels the model
    calls build into the swaserve cache's kernels/."""
    build.use_cache_dir(cache_root() / "kernels")
    source = resolve_model(config.model)
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


def plan_kv(config: EngineConfig, layout: CacheLayout, max_model_len: int,
            device: torch.device, prefix_cache: bool, pending_bytes: int = 0) -> MemoryPlan:
    """Pool sizes for the KV budget: `kv_memory`, else `mem_fraction` of free memory (less
    `pending_bytes`, what the model will still allocate: `CausalLM.pending_bytes`), else
    1 GiB; the prefix cache's window pages take `window_cache_memory` (a fifth) of it."""
    budget = config.kv_memory_bytes
    if budget is None and config.mem_fraction is not None:
        free = max(_free_memory_bytes(device) - pending_bytes, 0)
        budget = int(free * config.mem_fraction)
    budget = budget or DEFAULT_KV_MEMORY
    window_cache = 0
    if prefix_cache and layout.sliding_layers:
        window_cache = (parse_bytes(config.window_cache_memory) if config.window_cache_memory
                        else budget // 5)
    return plan_memory(layout, budget, DTYPE_BYTES[config.dtype],
                       chunk_size=config.step_tokens, page_size=config.page_size,
                       max_model_len=max_model_len,
                       max_running_requests=config.max_running_requests,
                       window_cache_bytes=window_cache)


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return DEFAULT_KV_MEMORY
