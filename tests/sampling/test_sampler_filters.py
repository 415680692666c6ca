"""The sampler's filters (top-k, top-p, min-p): draws follow the renormalised
distribution, and every filtering row's token is the full sort's, whether it comes from
the bounded or wide candidates, gumbel.c's kept set or the sort; ties across a cut keep
the smallest ids whatever the batch.

The sampling contract (docs/architecture.md), exact on fixed logits with no model; the
contract tests run on both samplers, torch's and the MLX one (mlx/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch

from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import Sampler
from tests.sampling.conftest import (
    BACKENDS,
    V,
    make_sampler,
    row,
    sorted_reference,
)


def _empirical(params: SamplingParams, logits: torch.Tensor, n: int, backend: str) -> torch.Tensor:
    s = make_sampler(backend)
    rows = [row(params, pos=i, seed=i) for i in range(n)]
    toks = s(logits.expand(n, V).clone(), rows).tokens
    return torch.bincount(toks, minlength=V).double()


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    x = logits[0].double() / temperature
    order = torch.argsort(x, descending=True)
    p = torch.softmax(x, -1)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[:top_k]] = True
    pk = torch.where(keep, p, 0)
    pk = pk / pk.sum()
    cum = 0.0
    for t in order.tolist():
        if not keep[t]:
            continue
        if cum >= top_p:
            keep[t] = False
        cum += pk[t].item()
    pk = torch.where(keep, pk, 0)
    keep &= pk >= min_p * pk.max()
    q = torch.where(keep, p, 0)
    return q / q.sum(), keep


@pytest.mark.parametrize("t,k,p,m", [(1.0, V, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, V, 0.6, 0.0),
                                     (1.0, V, 1.0, 0.1), (1.3, 20, 0.8, 0.02)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_filtered_sampling_matches_renormalised_distribution(t, k, p, m, backend):
    # distinct values (no ties at a filter boundary) with a heavy tail, so top-p cuts deep
    head = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.5, 1.0, 0.5])
    logits = torch.cat([head, -1.0 - 0.004 * torch.arange(V - 7)])[None, :]
    n = 20000
    counts = _empirical(SamplingParams(temperature=t, top_k=k if k < V else -1, top_p=p, min_p=m),
                        logits, n, backend)
    q, keep = _expected(logits, t, k, p, m)
    assert counts[~keep].sum() == 0  # nothing outside the filter, ever
    exp = q * n
    big = exp > 5
    chi2 = (((counts - exp) ** 2) / exp.clamp_min(1e-12))[big].sum().item()
    dof = int(big.sum()) - 1
    # fixed seeds make this deterministic; the bound is the chi-square 0.999 quantile, approx.
    assert chi2 < dof + 3.1 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked: candidates suffice; flat: sort fallback
@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_over_whole_vocabulary_matches_full_sort(scale, backend):
    v = 5000  # wider than the bounded candidate width
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, v, generator=g) * scale
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=0.7, top_p=0.5, seed=2),
              SamplingParams(temperature=1.0, min_p=0.01, seed=3), SamplingParams(temperature=1.2, top_p=0.95, min_p=0.001, seed=4)]
    rows = [row(p, pos=9 + i) for i, p in enumerate(params)]
    got = make_sampler(backend, v)(logits.clone(), rows).tokens
    for i, (p, r) in enumerate(zip(params, rows)):
        assert got[i].item() == sorted_reference(logits[i], p, r)


@pytest.mark.parametrize("nucleus_kernel", [True, False])
def test_nuclei_past_the_bounded_width_come_from_wide_candidates(monkeypatch, nucleus_kernel):
    """Rows whose kept set passes BOUNDED_TOP_K but fits WIDE_TOP_K (here 3,000 of 5,000)
    draw from the wide candidates, with the full sort's token; the others still sort.
    With gumbel.c's kernel every row takes it instead and none sorts; without it (forced
    off) they take those paths. Every token is the full sort's."""
    from swaserve.kernels import gumbel
    from swaserve.sampling import filtering

    if nucleus_kernel and gumbel.nucleus_entry() is None:
        pytest.skip("no C compiler for gumbel.c")
    if not nucleus_kernel:
        monkeypatch.setattr(gumbel, "nucleus_entry", lambda: None)
    monkeypatch.setattr(filtering, "WIDE_TOP_K", 3000)
    v = 5000
    logits = torch.randn(8, v, generator=torch.Generator().manual_seed(3)) * 2.0
    logits[6:] *= 0.02  # flat: past the wide width too
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=1.2, top_p=0.95, seed=2),
              SamplingParams(temperature=1.0, top_k=2000, top_p=0.99, seed=3),
              SamplingParams(temperature=1.0, min_p=0.0005, seed=4),
              SamplingParams(temperature=0.8, top_k=2500, seed=5),
              SamplingParams(temperature=1.0, top_p=0.6, seed=6),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7),
              SamplingParams(temperature=1.0, top_k=4000, top_p=0.97, seed=8)]
    rows = [row(p, pos=3 + i) for i, p in enumerate(params)]
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: (  # whole rows' sorts
        self.shape[-1] == v and sorts.append(self.shape[0]), real_sort(self, *a, **kw))[1])
    got = Sampler(v, torch.device("cpu"))(logits.clone(), rows).tokens
    monkeypatch.setattr(torch.Tensor, "sort", real_sort)
    nucleus = []
    for i, (p, r) in enumerate(zip(params, rows)):
        assert got[i].item() == sorted_reference(logits[i], p, r), i
        pr = torch.softmax(logits[i] / p.temperature, -1).sort(descending=True).values
        nucleus.append(int((pr.cumsum(0) - pr < p.top_p).sum()))
    assert sum(1024 < n <= 3000 for n in nucleus[:6]) >= 2, nucleus  # the wide tier ran
    # only the two flat rows sorted the vocabulary; with the kernel none did
    assert sorts == ([] if nucleus_kernel else [2])


@pytest.mark.parametrize("ties", [False, True])
def test_filtering_rows_from_the_kernel_draw_the_full_sorts_token(monkeypatch, ties):
    """Filtering rows (top-p, min-p, top-k, and together; peaked, spread and flat rows; a
    vocabulary that is not a multiple of 16; edited rows beside raw ones), each drawn by
    gumbel.c's kept set without a sort: the token of the whole sorted row (ties: logits on
    a grid of 1/4, so that equal values straddle the cuts, ordered by id)."""
    from swaserve.kernels import gumbel

    if gumbel.nucleus_entry() is None:
        pytest.skip("no C compiler for gumbel.c")
    v = 20003
    g = torch.Generator().manual_seed(41 + ties)
    scales = [6.0, 2.0, 1.0, 0.3, 0.05]
    logits = torch.cat([torch.randn(1, v, generator=g) * scales[i % 5] for i in range(30)])
    if ties:
        logits = (logits * 4).round() / 4
    # row 26 (top-p .99 at T = 1): three ids on top, the rest ~13 under them with ~2 % of
    # the mass, so that its nucleus ends past the buckets the kernel sums first
    logits[26] = -13 - 0.4 * torch.rand(v, generator=g)
    logits[26, [3, 500, 9000]] = torch.tensor([0.0, -0.5, -1.0])
    kinds = [dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.99), dict(min_p=0.05),
             dict(min_p=0.2, top_p=0.95), dict(top_p=0.95, temperature=0.7),
             dict(top_p=0.8, temperature=1.5, presence_penalty=0.5),
             dict(top_p=0.9, logit_bias={5: 3.0}), dict(top_k=40, top_p=0.9, temperature=0.8),
             dict(top_k=7), dict(top_k=3000, min_p=0.01), dict(top_k=1500, top_p=0.999)]
    params = [SamplingParams(seed=i, **{"temperature": 1.0, **kinds[i % len(kinds)]})
              for i in range(30)]
    rows = [row(p, pos=7 + i, out=(5, 9)) for i, p in enumerate(params)]
    from swaserve.sampling import filtering

    left = []
    real = filtering._draw_sorted
    monkeypatch.setattr(filtering, "_draw_sorted", lambda lg, fl, pos, st, idx, vocab: (
        left.extend(idx), real(lg, fl, pos, st, idx, vocab))[1])
    got = Sampler(v, torch.device("cpu"))(logits.clone(), rows).tokens
    monkeypatch.undo()
    # every row from the kernel but flat ones: at scale 1 or under every kept id is within
    # GUMBEL_LOW of the best, past the kernel's cap (a real model's rows keep tens)
    assert all(scales[i % 5] <= 1 and i != 26 for i in left), left
    assert params[26].top_p == 0.99 and params[26].temperature == 1.0
    probs = torch.softmax(logits[26].double(), -1).sort(descending=True).values
    assert probs[:3].sum() < 0.99  # the edge is in the tail, 12.6 and more under the max
    for i, (p, r) in enumerate(zip(params, rows)):
        x = logits[i].clone()
        if p.presence_penalty:
            x[[5, 9]] -= p.presence_penalty
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
        assert got[i].item() == sorted_reference(x, p, r), (i, p)



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_across_a_cut_keep_the_smallest_ids_whatever_the_batch(backend, dtype):
    """Equal logits (bf16 logits tie often) across a top-k or top-p cut: the kept ids are
    the first in (x descending, id ascending), whatever width the step's other rows ask
    for. torch's topk picked and ordered ties as it liked: top-k 2 of four equal ids kept
    900 at one width and not at another."""
    v = 4099
    x = torch.full((v,), -6.0)
    x[[900, 30, 4000, 7]] = 3.0  # four equal largest: top-k 2 keeps 7 and 30
    y = torch.full((v,), -6.0)
    y[[2000, 15]] = 3.0  # two equal largest, 0.4 of the mass each: top-p .3 keeps 15 alone
    logits = torch.stack([x, y, torch.randn(v, generator=torch.Generator().manual_seed(0))])
    logits = logits.to(dtype)
    s = make_sampler(backend, v)
    for seed in range(40):
        params = [SamplingParams(temperature=1.0, top_k=2, seed=seed),
                  SamplingParams(temperature=1.0, top_p=0.3, seed=seed),
                  SamplingParams(temperature=1.0, top_k=1000, seed=seed)]
        rows = [row(p, pos=9) for p in params]
        both = s(logits.clone(), rows).tokens.tolist()
        alone = [s(logits[i:i + 1].clone(), rows[i:i + 1]).tokens.item() for i in range(2)]
        assert both[0] in (7, 30) and both[1] == 15, (seed, both)
        assert both[:2] == alone, (seed, both, alone)
