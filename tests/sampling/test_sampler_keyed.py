"""Keyed sampling: each row's noise is MurmurHash3 of (seed, position, token id), bit for
bit, and finite at both ends; temperature-only rows pruned to their candidates get the
token of hashing every id, unseeded rows draw a seed and sample as seeded ones, and
gumbel.c keeps exactly the ids that can win.

The sampling contract (docs/architecture.md), exact on fixed logits with no model; the
contract tests run on both samplers, torch's and the MLX one (mlx/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch

from swaserve.kernels import murmur
from swaserve.sampling.params import SamplingParams
from tests.sampling.conftest import (
    BACKENDS,
    V,
    fixed_logits,
    hashed_reference,
    make_sampler,
    row,
)


def murmur3_ref(blocks: list[int]) -> int:
    """Pure-Python MurmurHash3 x86_32 over 32-bit blocks, seed 0."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF
    h = 0
    for k in blocks:
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = rotl(k, 15)
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 4 * len(blocks)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31, 2**63 + 12345])
def test_hash_matches_reference_bit_for_bit(seed):
    vocab = 262144
    toks = torch.tensor([0, 1, vocab // 2, vocab - 1])
    lo, hi = murmur.split_seed(seed)
    for pos in (0, 7, 511, 32767):
        prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([pos]))
        got = murmur.murmur_hash(prefix, toks)[0].tolist()
        assert got == [murmur3_ref([lo, hi, pos, t]) for t in toks.tolist()]


def test_noise_finite_at_both_ends():
    g = murmur.gumbel_from_hash(torch.tensor([0xFFFFFFFF, 0, 1, 12345]))
    assert math.isfinite(g[0].item()) and abs(g[0].item() - 22.18) < 0.01  # u = 1 clamp
    assert not torch.isnan(g).any() and g[1].item() == float("-inf")  # u = 0: never NaN


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_temperature_rows_prune_exactly(backend, dtype):
    """The pruned Gumbel-max of seeded temperature-only rows equals hashing every id (the
    candidates are found on the logits, in their own dtype, against the bound times the
    temperature); rows at 0.3 to 2.0, some sharing a logit row."""
    logits = (fixed_logits(6, seed=21) * 4).to(dtype)
    s = make_sampler(backend)
    rows = [row(SamplingParams(temperature=t, seed=100 + i), pos=5 + i)
            for i, t in enumerate((0.3, 0.7, 1.0, 1.0, 1.5, 2.0))]
    got = s(logits.clone(), rows).tokens
    for i, r in enumerate(rows):
        assert got[i].item() == hashed_reference(logits[i], r)


def test_unseeded_rows_draw_a_seed_and_sample_as_seeded_rows():
    """A row that samples without a seed takes one from the sampler's generator (one draw
    a row; greedy rows none) and is then a seeded row: its token is the hashed reference
    with that seed. Over many draws a temperature-only row follows softmax(x / T)."""
    import dataclasses

    logits = fixed_logits(4, seed=5) * 2
    rows = [row(SamplingParams(temperature=0.9), pos=7), row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=1.3), pos=9), row(SamplingParams(temperature=0.5))]
    s = make_sampler("torch", seed=123)
    got = s(logits.clone(), rows).tokens
    seeds = torch.randint(0, 2**62, (3,), generator=torch.Generator().manual_seed(123)).tolist()
    for i, seed in zip((0, 2, 3), seeds):
        assert got[i].item() == hashed_reference(logits[i], dataclasses.replace(rows[i], seed=seed))
    assert got[1].item() == logits[1].argmax().item()
    # the distribution: 4,000 rows of one peaked row at T = 0.7, 6 calls
    x = torch.full((V,), -30.0)
    x[:6] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    probs = torch.softmax(x / 0.7, -1)[:6].double()
    counts = torch.zeros(6, dtype=torch.float64)
    many = [row(SamplingParams(temperature=0.7), pos=3)] * 4000
    for _ in range(6):
        t = s(x.expand(len(many), V).contiguous(), many).tokens
        assert int(t.max()) < 6
        counts += torch.bincount(t, minlength=6).double()
    exp = probs / probs.sum() * counts.sum()
    chi2 = (((counts - exp) ** 2) / exp).sum().item()
    assert chi2 < 5 + 3.1 * math.sqrt(10) + 10, (chi2, counts.tolist())


def test_gumbel_candidates_are_the_ids_that_can_win_hashed_as_murmur_does(monkeypatch):
    """The C pass keeps an id when best - x is at most GUMBEL_LOW, or at most NOISE_MAX with
    a hash whose noise can pass GUMBEL_LOW: exactly that set, with murmur.py's hash (so
    the C hash is the torch one), holding every id whose exact score reaches `best`; a row
    with more than the cap gives None (the caller's own path)."""
    from swaserve.kernels import build, gumbel

    if gumbel.entry() is None:
        pytest.skip("no C compiler for the kernel")
    low = build.constants()["GUMBEL_LOW"]
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 20003, generator=g) * 3  # 16 ids at a time, and a tail
    temp = torch.tensor([0.4, 1.0, 1.0, 1.7, 3.0])
    prefix = murmur.row_prefix(torch.arange(5) * 77, torch.arange(5), torch.arange(5) + 9)
    ids = torch.arange(logits.shape[1])
    hashes = murmur.murmur_hash(prefix, ids)
    x = (logits / temp[:, None]).double()
    score = x + murmur.gumbel_from_hash(hashes)
    best = score.max(-1).values - torch.tensor([0.0, 0.0, 3.0, 0.0, 0.0], dtype=torch.float64)
    r, t = gumbel.candidates(logits, temp, best, prefix)
    got = torch.zeros_like(logits, dtype=torch.bool)
    got[r, t] = True
    d = best[:, None] - x
    high = math.floor(math.exp(-math.exp(-low)) * 4294967295.0) - 64
    want = (d <= low) | ((d <= murmur.NOISE_MAX) & (hashes >= high))
    assert torch.equal(got, want)
    assert got[score >= best[:, None]].all()  # every id that can win
    assert int(got.sum()) < int((d <= murmur.NOISE_MAX).sum()) // 10
    monkeypatch.setattr(gumbel, "CAP_PER_ROW", 2)
    assert gumbel.candidates(logits, temp, best, prefix) is None
    assert gumbel.candidates(logits.double(), temp, best, prefix) is None
