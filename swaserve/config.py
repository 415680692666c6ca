"""Engine configuration: frozen, validated once, never written back.

Values discovered at run time (pool sizes, eos ids, the model's context length) live on the
run-time objects that discover them (`ModelConfig`, `MemoryPlan`), not here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte size: 2147483648, "2GiB", "512MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ValueError(f"kv_memory: expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_memory: must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_memory: cannot parse byte size {value!r} (try '2GiB' or '512MiB')")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"kv_memory: must be positive, got {value!r}")
    return n


def cache_root() -> Path:
    """Where swaserve caches what is expensive to rebuild (converted tokenizers, dequantized
    weights, built kernels): $SWASERVE_CACHE_DIR, else $XDG_CACHE_HOME/swaserve."""
    root = os.environ.get("SWASERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swaserve")
    return Path(root)


DTYPES = ("bfloat16", "float32", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # memory/kv_quant.py
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32", "fp16": "float16",
                  "f16": "float16", "half": "float16", "float": "float32"}


def normalize_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return name


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user chooses about an engine. The CLI flags are built from these fields."""

    model: str | None = field(default=None, metadata={
        "help": "a GGUF file, an HF-style directory (config.json + safetensors), a Hugging Face "
                "repo id (org/name) or a GGUF repo and quantization (org/name-GGUF:Q4_K_M); "
                "default: the bundled Gemma 3 270M"})
    revision: str | None = field(default=None, metadata={
        "help": "branch, tag or commit of a Hugging Face repo id model (default: main)"})
    dtype: str = field(default="bfloat16", metadata={"help": "compute and KV dtype"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or mlx (Apple silicon; mlx[cpu] on Linux)"})
    max_running_requests: int | None = field(default=None, metadata={
        "help": "request rows (each prepays its sliding-window rings); default: derived from the budget"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output per request; default: the model's context length"})
    chunk_size: int = field(default=512, metadata={"help": "prefill token budget per step"})
    page_size: int = field(default=16, metadata={"help": "tokens per full-attention KV page"})
    kv_memory: str | None = field(default=None, metadata={
        "help": "KV cache budget, e.g. 2GiB (default 1GiB unless --mem-fraction is given)"})
    mem_fraction: float | None = field(default=None, metadata={
        "help": "KV budget as a fraction of free memory after weights and activations"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "how the KV cache stores K and V: 'auto' (the compute dtype), 'int8' or "
                "'fp8_e4m3' (8-bit values and a float32 scale per 32 of them: 0.56 of bf16's "
                "bytes, so 1.8 times the context; not on device mlx)"})
    prefix_cache: bool = field(default=True, metadata={"help": "share the KV of cached prompt prefixes"})
    profile: bool = field(default=False, metadata={
        "help": "time each part of a step (LM head, projections, attention, host work): "
                "Engine.profile.report(); SWASERVE_PROFILE=1 does the same"})
    json_bounds: bool = field(default=True, metadata={
        "help": "JSON-schema output: numbers the schema leaves open get at most 16 integer "
                "and 10 fraction digits and no exponent, so that an answer ends"})
    window_cache_memory: str | None = field(default=None, metadata={
        "help": "prefix cache budget for sliding-layer KV of cached tokens, inside kv_memory "
                "(default: a fifth of it)"})
    state_cache_memory: str | None = field(default=None, metadata={
        "help": "prefix cache budget for recurrent-state checkpoints of cached tokens "
                "(models with Gated DeltaNet layers: Qwen3.5), inside kv_memory (default: a "
                "fifth of it)"})
    state_checkpoint_interval: int = field(default=1024, metadata={
        "help": "models with recurrent layers: the prefix cache keeps a state checkpoint "
                "every this many tokens (rounded up to whole pages) and at each prompt's "
                "last page boundary; a hit restores the deepest one and recomputes the rest"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a request's output does not depend on what runs beside it, in bf16 too: "
                "matmuls in blocks of 32 rows, decode keys padded to 512, prompts chunked at "
                "fixed positions, no prefix cache (slower prefill)"})
    int8_weights: bool = field(default=True, metadata={
        "help": "decode batches multiply the GGUF's quantized weights as int8 blocks, half "
                "the bytes of bf16: few rows on the exact weights (AVX-512 VNNI), more on their "
                "bf16 values (AMX tiles, or AVX-512 BF16 without AMX); on a CPU with a C "
                "compiler, in bf16 or float16, without batch_invariant or tensor parallelism. "
                "device mlx: Q8_0, Q5_0 and Q4_K weights through MLX's quantized matmul, "
                "exactly (not in float32)"})
    head_screen: bool = field(default=True, metadata={
        "help": "with int8 weights on a CPU with AVX-512 VNNI and BF16 and no AMX, greedy "
                "rows and rows sampled by a temperature alone take the LM head's tokens from "
                "an int8 screen of it and their few candidates' exact sums: the same tokens "
                "with fewer of the head's products, from 9 rows on; its copy of the head (its "
                "int8 size) is made at the first such step"})
    int8_activations: bool = field(default=False, metadata={
        "help": "with int8 weights on a CPU with AVX-512 VNNI and BF16 and no AMX, the "
                "layers' products that would take bf16 activations (decode steps past 8 rows, "
                "prompt chunks) take them as int8 with a scale per 32 (VPDPBUSD): faster "
                "products, further from exact than with bf16 activations, so greedy text "
                "parts from the default path more often; for throughput over fidelity"})
    overlap: bool | None = field(default=None, metadata={
        "help": "schedule and prepare the next step while the current one computes (default: "
                "on a GPU; off on a CPU, whose cores the forward keeps busy, so the work "
                "beside it only takes a core from the forward's threads)"})
    speculative: str | None = field(default=None, metadata={
        "help": "speculative decoding: 'ngram' drafts the continuation of the last n tokens' "
                "latest earlier occurrence in the request's prompt and output, verified in one "
                "step; the output is the non-speculative output token for token"})
    num_draft_tokens: int = field(default=4, metadata={
        "help": "draft tokens per request and step at most (adapted to each request's "
                "acceptance)"})
    ngram_max: int = field(default=4, metadata={"help": "longest n-gram a draft is looked up by"})
    ngram_min: int = field(default=2, metadata={"help": "shortest n-gram a draft is looked up by"})
    speculative_max_rows: int = field(default=32, metadata={
        "help": "decode rows a speculative step grows to at most (drafts beyond wait; on this "
                "2-core CPU a row past 32 costs nearly what it brings: raise it on a GPU); "
                "within it, drafts pause at a batch size where they make tokens no cheaper"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "shard the model over this many processes (torch.distributed: gloo on a "
                "CPU, NCCL on GPUs); rank 0 schedules, samples and serves. On one machine "
                "the other ranks are spawned; MASTER_ADDR / MASTER_PORT set the rendezvous"})
    nnodes: int = field(default=1, metadata={
        "help": "machines the tensor-parallel ranks span (tensor_parallel_size / nnodes each)"})
    node_rank: int = field(default=0, metadata={
        "help": "this machine's place among them; 0 serves, the others only compute"})
    master_addr: str | None = field(default=None, metadata={
        "help": "the rendezvous host (node 0; default MASTER_ADDR or this machine)"})
    master_port: int | None = field(default=None, metadata={
        "help": "the rendezvous port (default MASTER_PORT, or a free one on one machine)"})
    pooling: str | None = field(default=None, metadata={
        "help": "embeddings: 'mean', 'last' (token) or 'cls' (first token) pooling of a "
                "prompt's hidden states (default: the sentence-transformers Pooling module "
                "beside the checkpoint, else mean for a bidirectional model and last for a "
                "decoder)"})
    seed: int = field(default=0, metadata={"help": "seed of the engine's generator for unseeded sampling"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: all cores)"})
    adaptive_threads: bool = field(default=True, metadata={
        "help": "on a CPU, use fewer threads while another process takes a core, all of "
                "them again once it is gone (engine/threads.py; off in batch-invariant mode)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.device not in ("cpu", "cuda", "mlx") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'mlx', got {self.device!r}")
        if self.pooling not in (None, "mean", "last", "cls"):
            raise ValueError(f"pooling: expected 'mean', 'last' or 'cls', got {self.pooling!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.device == "mlx":
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype} is not available with "
                             "device mlx (its cache stores the compute dtype)")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative: expected 'ngram' or none, got {self.speculative!r}")
        for name in ("chunk_size", "page_size", "num_draft_tokens", "ngram_max", "ngram_min",
                     "speculative_max_rows", "tensor_parallel_size", "nnodes",
                     "state_checkpoint_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        for name in ("max_running_requests", "max_model_len", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} machines cannot hold "
                             f"{self.tensor_parallel_size} ranks evenly")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size > 1:
            for name, on in (("speculative", self.speculative is not None),
                             ("overlap", self.overlap is True),
                             ("batch_invariant", self.batch_invariant)):
                if on:
                    raise ValueError(f"{name}: not available with tensor_parallel_size > 1")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min: {self.ngram_min} is above ngram_max {self.ngram_max}")
        if self.kv_memory is not None:
            parse_bytes(self.kv_memory)
        if self.window_cache_memory is not None:
            parse_bytes(self.window_cache_memory)
        if self.state_cache_memory is not None:
            parse_bytes(self.state_cache_memory)
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction: must be in (0, 1], got {self.mem_fraction!r}")

    @property
    def step_tokens(self) -> int:
        """Positions one request writes in a step at most: a prompt chunk, or a decode token
        and its draft (the sliding rings are W plus this)."""
        return max(self.chunk_size, self.num_draft_tokens + 1 if self.speculative else 1)

    @property
    def draft_state_slots(self) -> int:
        """Draft tokens one step holds at most (each a recurrent-state snapshot): the decode
        rows a speculative step grows to and its token budget, less a decode token."""
        if not self.speculative:
            return 0
        return max(0, min(self.speculative_max_rows, self.chunk_size) - 1)

    @property
    def kv_memory_bytes(self) -> int | None:
        return None if self.kv_memory is None else parse_bytes(self.kv_memory)

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)
