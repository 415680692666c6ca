"""The backend seam: what the engine asks of the array library its model runs on.

The scheduler, the KV bookkeeping (rows, page tables, ring positions, the prefix tree), the
planner and the sample stage are backend-free Python over torch CPU index tensors; a
backend turns the loaded model and the KVCache's layout into its own arrays, runs the
forward over the runner's ForwardContext and samples from what its LM head returns
(models/head.py HeadOutput). The `Backend` Protocol has nine members, two attributes and
seven methods:

- `prepare(config)`: the config it runs (or a ValueError naming what it cannot do);
- `host_device(config)`: where the index tables, the sampler's inputs and the torch
  model it is built from live;
- `kv_device`: where the KVCache's torch pools keep their data ("meta": nowhere, the
  backend holds the data and the cache logs every move for it);
- `model(model, cache, source)`: the callable the runner calls with a ForwardContext, which
  returns a HeadOutput;
- `sampler(vocab, device, seed)`: called like sampling/sampler.py's Sampler on that model's
  HeadOutput;
- `to_host(logits)`: the logits as a torch tensor (diagnostics: `Engine.logits_log`);
- `end_step()`: after the sample stage (a lazy backend evaluates what no row did);
- `overlaps_by_default(device)`: whether overlap scheduling is on unless asked (on an
  accelerator: the host prepares the next step meanwhile; not on a CPU, whose cores the
  forward keeps busy); `torch_threads`: whether the forward runs on torch's CPU threads
  (the ThreadGovernor then adapts their count).

TorchBackend is the default and the identity; device="mlx" takes mlx/backend.py's
MLXBackend.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from swaserve.checkpoint.source import ModelSource
from swaserve.config import EngineConfig
from swaserve.memory.kv_cache import KVCache
from swaserve.sampling.sampler import Sampler


class Backend(Protocol):
    """The array library a model runs on (the module docstring says what each member is)."""

    kv_device: str | None
    torch_threads: bool

    def prepare(self, config: EngineConfig) -> EngineConfig: ...

    def host_device(self, config: EngineConfig) -> torch.device: ...

    def model(self, model: Any, cache: KVCache, source: ModelSource) -> Any: ...

    def sampler(self, vocab_size: int, device: torch.device, seed: int) -> Any: ...

    def to_host(self, logits: Any) -> torch.Tensor: ...

    def end_step(self) -> None: ...

    def overlaps_by_default(self, device: torch.device) -> bool: ...


class TorchBackend:
    kv_device: str | None = None
    torch_threads = True

    def overlaps_by_default(self, device: torch.device) -> bool:
        return device.type != "cpu"

    def prepare(self, config: EngineConfig) -> EngineConfig:
        if str(config.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no CUDA device")
        return config

    def host_device(self, config: EngineConfig) -> torch.device:
        return torch.device(config.device)

    def model(self, model, cache: KVCache, source: ModelSource):
        return model

    def sampler(self, vocab_size: int, device: torch.device, seed: int):
        return Sampler(vocab_size, device, seed)

    def to_host(self, logits) -> torch.Tensor:
        return logits

    def end_step(self) -> None:
        pass


def backend_for(config: EngineConfig) -> Backend:
    if config.device == "mlx":
        from swaserve.mlx.backend import MLXBackend
        return MLXBackend()
    return TorchBackend()
