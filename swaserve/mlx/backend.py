"""The MLX backend (engine/backend.py's `Backend` Protocol): the model's forward, the KV
data and the sampler in MLX; the torch model it is converted from, the index tables and the
sampler's inputs on the CPU."""

from __future__ import annotations

import dataclasses

import torch

from swaserve.checkpoint.source import ModelSource
from swaserve.checkpoint.weights import load_q8_weights
from swaserve.config import EngineConfig
from swaserve.memory.kv_cache import KVCache
from swaserve.mlx import require


class MLXBackend:
    kv_device = "meta"
    torch_threads = False

    def overlaps_by_default(self, device: torch.device) -> bool:
        mx = require()
        return mx.default_device() == mx.gpu  # Metal computes while the host prepares

    def __init__(self):
        self.quantized = False
        self.mlx_model = None

    def prepare(self, config: EngineConfig) -> EngineConfig:
        require()
        for name, on in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                         ("batch_invariant", config.batch_invariant)):
            if on:
                raise ValueError(f"device: mlx does not support {name} yet")
        # the GGUF's quantized weights go to MLX's own format (mlx/quant.py), not torch's int8
        self.quantized = config.int8_weights and config.dtype != "float32"
        return dataclasses.replace(config, int8_weights=False)

    def host_device(self, config: EngineConfig) -> torch.device:
        return torch.device("cpu")

    def model(self, model, cache: KVCache, source: ModelSource):
        from swaserve.mlx.cache import MLXKV
        from swaserve.mlx.model import MLXCausalLM

        if not model.runs_on_mlx:
            raise ValueError(f"device: mlx does not run {model.cfg.architecture} yet")
        quant = load_q8_weights(source, model.cfg.num_layers) if self.quantized else None
        self.mlx_model = MLXCausalLM(model, MLXKV(cache, cache.dtype), quant)
        return self.mlx_model

    def sampler(self, vocab_size: int, device: torch.device, seed: int):
        from swaserve.mlx.sampler import MLXSampler

        return MLXSampler(vocab_size, self.mlx_model.step, seed)

    def to_host(self, logits) -> torch.Tensor:
        from swaserve.mlx.cache import to_torch

        return to_torch(logits)

    def end_step(self) -> None:
        self.mlx_model.step.evaluate()  # the lazy forward, if no row's sampling evaluated it
