"""What the sampler's contract tests share: the backends they run on (torch's sampler
and the MLX one, skipped where mlx cannot be imported), sampler rows and fixed logits, and
the references a seeded row's token is held to (hashing every id, or drawing over the whole
sorted vocabulary)."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import murmur
from swaserve.mlx import available as mlx_available
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.rows import SamplerRow
from swaserve.sampling.sampler import Sampler

V = 1000
BACKENDS = ["torch", pytest.param("mlx", marks=[
    pytest.mark.skipif(not mlx_available(),
                       reason="mlx is not installed (pip install \"mlx[cpu]\" on Linux)"),
    pytest.mark.cpu_only])]


def make_sampler(backend: str, vocab: int = V, seed: int = 0):
    """A sampler called with torch logits: torch's, or the MLX one on the same logits."""
    if backend == "torch":
        return Sampler(vocab, torch.device("cpu"), seed)
    from swaserve.mlx.cache import to_mx
    from swaserve.mlx.sampler import MLXSampler
    from swaserve.mlx.step import StepGraph

    s = MLXSampler(vocab, StepGraph(), seed)

    def sample(logits, rows):
        return s(to_mx(logits), rows)
    sample.generator = s.generator
    return sample


def row(p: SamplingParams, pos: int = 10, prompt=(1, 2), out=(), seed=None) -> SamplerRow:
    return SamplerRow(p, seed if seed is not None else p.seed, pos, list(prompt), list(out))


def fixed_logits(b: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3


def hashed_reference(logits_row: torch.Tensor, r) -> int:
    """The token of a keyed temperature-only row, hashing every id."""
    lo, hi = murmur.split_seed(r.seed)
    prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([r.position]))
    g = murmur.gumbel_from_hash(murmur.murmur_hash(prefix, torch.arange(len(logits_row))))[0]
    return ((logits_row.float() / r.params.temperature).double() + g).argmax().item()


def sorted_reference(logits_row: torch.Tensor, p: SamplingParams, r) -> int:
    """The token of a seeded filtering row drawn over the whole sorted vocabulary."""
    from swaserve.sampling.filtering import filter_sorted

    vals, ids = (logits_row / p.temperature).sort(descending=True, stable=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else len(vals)])
    keep = filter_sorted(vals[None], top_k, torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
    lo, hi = murmur.split_seed(r.seed)
    prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([r.position]))
    noise = murmur.gumbel_from_hash(murmur.murmur_hash(prefix, ids))[0]
    return ids[(vals.double() + noise).masked_fill(~keep, float("-inf")).argmax()].item()
