"""Differential fuzzing of the sampler: hypothesis draws batches of rows (every sampling
parameter, in and at the edges of its valid range: temperatures from just over greedy to
huge, top-k past the vocabulary, top-p near 0, min-p near 1, biases of +-100, penalties,
grammar masks that leave one id, logprobs) over logits of every shape the fast paths treat
apart (peaked, flat, ties, vocabularies under one vector or not a multiple of 16). Each
row's token must be the one a full stable sort of its edited row draws with its keyed
noise (the definition the fast paths shortcut: gumbel.c's candidates and kept sets, the
bounded and wide candidates), whatever the other rows of its batch; logprobs are
log_softmax of the scaled row. On torch's sampler and the MLX one. Bounded: a fixed number
of derandomized examples on small vocabularies (~40 s in all).

It found: ties across a top-k or top-p cut kept the ids torch's topk (MLX's argpartition)
happened to pick, not the smallest, so a seeded row's token could change with the width
its neighbours asked for; and the MLX sampler's logprobs lost ~0.03 at a temperature of
2e-5 (x - logsumexp(x) at x ~ 1e5)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.kernels import murmur
from swaserve.mlx import available as mlx_available
from swaserve.sampling.filtering import filter_sorted
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.rows import SamplerRow
from swaserve.sampling.sampler import Sampler

EXAMPLES = 600
BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not mlx_available(), reason="mlx is not installed (pip install \"mlx[cpu]\" on Linux)"))]

VOCABS = [7, 16, 33, 1000, 4099]
STYLES = ["normal", "peaked", "flat", "ties", "huge", "one_allowed"]
PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-6, 2e-5, 1e-3, 0.05, 0.3, 0.7, 1.0, 1.0, 1.7,
                                    10.0, 1e4, 1e30]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 5, 40, 999, 4099, 5000]),
    "top_p": st.sampled_from([1.0, 1.0, 0.999, 0.95, 0.9, 0.5, 1e-6]),
    "min_p": st.sampled_from([0.0, 0.0, 1e-4, 0.05, 0.5, 0.999]),
    "presence_penalty": st.sampled_from([0.0, 0.0, 1.5, -2.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.0, 0.7]),
    "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3, 0.5]),
    "bias": st.sampled_from([None, None, 100.0, -100.0, 3.0]),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "logprobs": st.sampled_from([None, None, 0, 3]),
    "mask": st.booleans(),
})


def make_logits(vocab: int, style: str, rows: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g)
    if style == "peaked":
        return x * 8
    if style == "flat":
        return x * 0.01
    if style == "ties":  # equal values straddle every cut: order by id decides
        return (x * 8).round() / 4
    if style == "huge":
        return x * 1e4
    return x * 2


def make_sampler(backend: str, vocab: int, seed: int):
    """torch's sampler, or the MLX one called with torch logits (its steps read MLX arrays)."""
    if backend == "torch":
        return Sampler(vocab, torch.device("cpu"), seed)
    from swaserve.mlx.cache import to_mx
    from swaserve.mlx.sampler import MLXSampler
    from swaserve.mlx.step import StepGraph

    inner = MLXSampler(vocab, StepGraph(), seed)

    class Wrapped:
        keyed = inner.keyed

        def __call__(self, logits, rows):
            return inner(to_mx(logits), rows)
    return Wrapped()


def edited(x: torch.Tensor, r: SamplerRow) -> torch.Tensor:
    """Row r's logits x [V] in float32 with its edits, by their definitions: + logit bias,
    + grammar mask, repetition penalty on tokens seen in prompt or output, then frequency
    and presence penalties over the output's counts."""
    p = r.params
    x = x.float().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if r.grammar_bias is not None:
        x += r.grammar_bias
    counts = torch.bincount(torch.tensor(list(r.output_ids), dtype=torch.int64),
                            minlength=len(x)).float()
    seen = counts > 0
    seen[list(r.prompt_ids)] = True
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def reference(x: torch.Tensor, r: SamplerRow, edge: float = 0.0) -> int:
    """The token of row r over its logits x [V] by the definition: edits, temperature,
    the full stable sort (x descending, id ascending), its kept set and argmax(x + g);
    with `edge`, top-p and min-p moved by that fraction."""
    p = r.params
    x = edited(x, r)
    if p.greedy:
        return int(x.argmax())
    vals, ids = (x / p.temperature).sort(descending=True, stable=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else len(vals)])
    keep = filter_sorted(vals[None], top_k, torch.tensor([min(1.0, p.top_p * (1 + edge))]),
                         torch.tensor([p.min_p * (1 + edge)]))[0]
    lo, hi = murmur.split_seed(r.seed)
    prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([r.position]))
    noise = murmur.gumbel_from_hash(murmur.murmur_hash(prefix, ids))[0]
    return int(ids[(vals.double() + noise).masked_fill(~keep, float("-inf")).argmax()])


@pytest.fixture(scope="module")
def kernel_calls():
    """Counts of the C kernels' calls over the module's examples (the differential check
    would pass vacuously if no row reached them: all greedy, or all sorted in torch), and
    of the rows that drew another kept set's token at a float32 edge of top-p or min-p."""
    from swaserve.kernels import gumbel

    if gumbel.nucleus_entry() is None:
        pytest.skip("no C compiler for gumbel.c")
    calls = {"candidates": 0, "nucleus_candidates": 0, "torch": 0, "rows": 0, "edges": 0}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("candidates", "nucleus_candidates"):
            real = getattr(gumbel, name)

            def counted(*a, _real=real, _name=name, **kw):
                found = _real(*a, **kw)
                calls[_name] += found is not None
                return found
            mp.setattr(gumbel, name, counted)
        yield calls
    assert calls["edges"] <= calls["rows"] // 100, calls  # an edge is rare, not a habit
    if calls["torch"]:  # the MLX sampler has its own ops
        assert calls["candidates"] >= 20 and calls["nucleus_candidates"] >= 20, calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(vocab=st.sampled_from(VOCABS), style=st.sampled_from(STYLES),
       rows=st.lists(PARAMS, min_size=1, max_size=6), data_seed=st.integers(0, 2**31))
def test_every_row_draws_the_full_sorts_token(kernel_calls, backend, dtype, vocab, style, rows,
                                              data_seed):
    g = torch.Generator().manual_seed(data_seed)
    logits = make_logits(vocab, style, len(rows), g).to(dtype)
    batch = []
    for i, d in enumerate(rows):
        bias_id = int(torch.randint(0, vocab, (1,), generator=g))
        params = SamplingParams(
            temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"], min_p=d["min_p"],
            presence_penalty=d["presence_penalty"], frequency_penalty=d["frequency_penalty"],
            repetition_penalty=d["repetition_penalty"], seed=d["seed"], logprobs=d["logprobs"],
            logit_bias=None if d["bias"] is None else {bias_id: d["bias"]})
        mask = None
        if d["mask"] or style == "one_allowed":  # a grammar's mask: one id, or a random half
            allowed = (torch.rand(vocab, generator=g) < (0.0 if style == "one_allowed" else 0.5))
            allowed[int(torch.randint(0, vocab, (1,), generator=g))] = True
            mask = torch.zeros(vocab).masked_fill(~allowed, float("-inf"))
        history = torch.randint(0, vocab, (6,), generator=g).tolist()
        batch.append(SamplerRow(params, d["seed"], 40 + i, history[:3], history[3:],
                                grammar_bias=mask))
    kernel_calls["torch"] += backend == "torch"
    sampler = make_sampler(backend, vocab, data_seed)
    batch = sampler.keyed(batch)  # as the engine does before its forward
    out = sampler(logits.clone(), batch)
    assert not out.failed
    for i, r in enumerate(batch):
        tok = int(out.tokens[i])
        assert 0 <= tok < vocab
        if r.grammar_bias is not None:
            assert r.grammar_bias[tok] == 0, (i, "a masked token")
        # a mass on the top-p or min-p edge to float32's precision: gumbel.c's float64 sums
        # and MLX's cumsum may decide it apart from this reference's float32 ones
        if tok != reference(logits[i], r):
            assert tok in {reference(logits[i], r, e) for e in (-1e-5, 1e-5)}, (i, r.params)
            kernel_calls["edges"] += 1
        kernel_calls["rows"] += 1
    for j, i in enumerate(out.logprob_rows):
        x = edited(logits[i], batch[i]) / (1.0 if batch[i].params.greedy
                                             else batch[i].params.temperature)
        lp = torch.log_softmax(x, -1)
        chosen = float(out.chosen_logprob[j])
        want = float(lp[int(out.tokens[i])])
        # float32 round-off of the scaled logits themselves: ~8 units of the largest's last place
        tol = 1e-5 + 1e-6 * float(x[x.isfinite()].abs().max())
        assert chosen == want or math.isclose(chosen, want, rel_tol=1e-5, abs_tol=tol), (
            i, chosen, want)
        n = batch[i].params.logprobs
        if n:
            assert torch.equal(out.top_ids[j, :n], lp.topk(n).indices) or torch.allclose(
                lp[out.top_ids[j, :n]], lp.topk(n).values)
    # and alone: a row's token does not depend on the rows beside it
    i = int(torch.randint(0, len(batch), (1,), generator=g))
    alone = make_sampler(backend, vocab, 1)(logits[i:i + 1].clone(), [batch[i]])
    assert int(alone.tokens[0]) == int(out.tokens[i])

