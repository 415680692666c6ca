"""The sampling contract (docs/architecture.md): the sampler on fixed logits (exact, fast, no
model needed). The contract tests run on both samplers: torch's and the MLX one
(mlx/sampler.py, skipped where mlx cannot be imported)."""

from __future__ import annotations

import math

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


def row(p: SamplingParams, pos: int = 10, prompt=(1, 2), out=(), seed=None) -> SamplerRow:
    return SamplerRow(p, seed if seed is not None else p.seed, pos, list(prompt), list(out))


def fixed_logits(b: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_exact_and_consume_no_randomness(backend):
    s = make_sampler(backend)
    logits = fixed_logits(3)
    out = s(logits.clone(), [row(SamplingParams(temperature=0)) for _ in range(3)])
    assert torch.equal(out.tokens, logits.argmax(-1))
    state = s.generator.get_state()
    mixed = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0, logit_bias={5: 100}))]
    out = s(logits[:2].clone(), mixed)
    assert out.tokens.tolist() == [logits[0].argmax().item(), 5]
    assert torch.equal(s.generator.get_state(), state)


MIX = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2),
       SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.2),
       SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5,
                      repetition_penalty=1.3), SamplingParams(temperature=1.0)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=7),
                                    SamplingParams(temperature=1.0, top_k=40, seed=7),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=7),
                                    SamplingParams(temperature=1.0, min_p=0.05, seed=7)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_row_is_batch_invariant(params, backend):
    logits = fixed_logits(16, seed=3)
    mine = logits[0:1]
    alone = [make_sampler(backend, seed=s)(mine.clone(), [row(params, pos=p)]).tokens.item()
             for s, p in ((0, 10), (1, 10))]
    assert alone[0] == alone[1]  # across runs and engine seeds
    for pos_in_batch in (0, 5, 15):
        batch = logits.clone()
        batch[pos_in_batch] = mine[0]
        rows = [row(MIX[i % len(MIX)], pos=10 + i, out=(3, 4)) for i in range(16)]
        rows[pos_in_batch] = row(params, pos=10)
        got = make_sampler(backend, seed=99)(batch, rows).tokens[pos_in_batch].item()
        assert got == alone[0]
    # a batchmate with top_k > 1024 sends every filtering row down the full-vocabulary path
    wide = [row(params, pos=10), row(SamplingParams(temperature=1.0, top_k=2000, top_p=0.99))]
    both = torch.cat([mine, logits[1:2]])
    assert make_sampler(backend)(both, wide).tokens[0].item() == alone[0]


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_penalties_and_bias_exactly_as_specified(backend):
    s = make_sampler(backend)
    logits = fixed_logits(1, seed=5)
    p = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25,
                       repetition_penalty=1.5, logit_bias={7: 2.0}, logprobs=0)
    out_ids, prompt = [3, 3, 9], [9, 11]
    out = s(logits.clone(), [row(p, prompt=prompt, out=out_ids)])
    ref = logits[0].clone()
    ref[7] += 2.0
    for t in {3, 9, 11}:
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    ref[3] -= 0.5 * 2 + 0.25
    ref[9] -= 0.5 * 1 + 0.25
    assert out.tokens.item() == ref.argmax().item()
    lp = torch.log_softmax(ref, -1)
    assert abs(out.chosen_logprob.item() - lp[out.tokens.item()].item()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_equal_log_softmax_of_scaled_logits(backend):
    s = make_sampler(backend)
    logits = fixed_logits(2, seed=8)
    out = s(logits.clone(), [row(SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1)),
                             row(SamplingParams(temperature=0, logprobs=2))])
    lp0 = torch.log_softmax(logits[0] / 0.5, -1)
    vals, ids = lp0.topk(5)
    assert torch.allclose(out.top_logprobs[0], vals, atol=1e-5)
    assert torch.equal(out.top_ids[0], ids)
    assert abs(out.chosen_logprob[0].item() - lp0[out.tokens[0]].item()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_keep_their_precision_at_a_tiny_temperature(backend):
    """At T = 2e-5 the scaled logits are ~1e5-1e6, where float32's spacing is 0.01-0.06:
    log_softmax must take the max off before the log-sum-exp, or the best token's logprob
    (0 or log 1/2 here) comes out off by a fraction of it (the MLX sampler's: 0.006)."""
    t = 2e-5
    logits = fixed_logits(2, seed=8)
    logits[1, [3, 9]] = logits[1].max() + 1  # two equal best: log(1/2) each
    out = make_sampler(backend)(logits.clone(), [
        row(SamplingParams(temperature=t, logprobs=2, seed=1)) for _ in range(2)])
    want = torch.log_softmax(logits.double() / t, -1)
    for i in range(2):
        assert abs(out.chosen_logprob[i].item() - want[i, out.tokens[i]].item()) < 1e-6
    assert abs(out.chosen_logprob[1].item() - math.log(0.5)) < 1e-6

@pytest.mark.parametrize("kw,name", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.0}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": "a"}, "seed"),
    ({"stop": [""]}, "stop"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")])
def test_invalid_parameters_name_themselves(kw, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        SamplingParams(**kw)


def test_unknown_token_in_logit_bias_rejected():
    with pytest.raises(ValueError, match="^logit_bias: unknown token id 5000"):
        SamplingParams(logit_bias={5000: 1.0}).validate(vocab_size=V)


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
        assert got[i].item() == _hashed_reference(logits[i], r)


def _hashed_reference(logits_row: torch.Tensor, r) -> int:
    """The token of a keyed temperature-only row, hashing every id."""
    lo, hi = murmur.split_seed(r.seed)
    prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([r.position]))
    g = murmur.gumbel_from_hash(murmur.murmur_hash(prefix, torch.arange(len(logits_row))))[0]
    return ((logits_row.float() / r.params.temperature).double() + g).argmax().item()


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
        assert got[i].item() == _hashed_reference(logits[i], dataclasses.replace(rows[i], seed=seed))
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


def _sorted_reference(logits_row: torch.Tensor, p: SamplingParams, r) -> int:
    """The token of a seeded filtering row drawn over the whole sorted vocabulary."""
    from swaserve.sampling.filtering import filter_sorted

    vals, ids = (logits_row / p.temperature).sort(descending=True, stable=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else len(vals)])
    keep = filter_sorted(vals[None], top_k, torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
    lo, hi = murmur.split_seed(r.seed)
    prefix = murmur.row_prefix(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([r.position]))
    noise = murmur.gumbel_from_hash(murmur.murmur_hash(prefix, ids))[0]
    return ids[(vals.double() + noise).masked_fill(~keep, float("-inf")).argmax()].item()


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
        assert got[i].item() == _sorted_reference(logits[i], p, r)


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
        assert got[i].item() == _sorted_reference(logits[i], p, r), i
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
        assert got[i].item() == _sorted_reference(x, p, r), (i, p)



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

def test_split_logits_give_the_tokens_and_logprobs_of_whole_logits():
    """A step whose greedy rows come as argmaxes beside the other rows' logits (a SPLIT HeadOutput,
    the LM head's split) samples every row as whole logits would: the same tokens, the
    same logprobs on the same rows; the row-by-row retry's one-row slices too. A keyed
    temperature-only row's token may come with them (the head's screen draws it); a token
    for a row that filters, asks for logprobs or has no seed is refused."""
    from swaserve.models.head import HeadOutput

    logits = fixed_logits(6, seed=11)
    rows = [row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0.7, seed=3)),
            row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0.9, top_k=5, logprobs=3, seed=4)),
            row(SamplingParams(temperature=0, logprobs=2)),
            row(SamplingParams(temperature=0))]
    greedy = [0, 2, 5]
    others = [1, 3, 4]
    split = HeadOutput.of_split(logits[others].clone(), logits[greedy].argmax(-1), greedy)
    assert split.shape == (6, V) and split.others == others
    whole = Sampler(V, torch.device("cpu"), 0)(logits.clone(), rows)
    got = Sampler(V, torch.device("cpu"), 0)(split, rows)
    assert torch.equal(got.tokens, whole.tokens)
    assert got.logprob_rows == whole.logprob_rows == [3, 4]
    assert torch.equal(got.chosen_logprob, whole.chosen_logprob)
    assert torch.equal(got.top_ids, whole.top_ids)
    s = Sampler(V, torch.device("cpu"), 0)
    for j in range(6):
        one = s(split[j:j + 1], rows[j:j + 1])
        assert one.tokens.tolist() == [whole.tokens[j].item()]
    drawn = HeadOutput.of_split(logits[[3, 4]].clone(), whole.tokens[[0, 1, 2, 5]], [0, 1, 2, 5])
    assert torch.equal(s(drawn, rows).tokens, whole.tokens)
    for bad in (3, 4):
        with pytest.raises(ValueError, match="tokens for rows it cannot sample"):
            s(HeadOutput.of_split(logits[[0]], logits[[bad]].argmax(-1), [1]), [rows[0], rows[bad]])
    unseeded = row(SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="tokens for rows it cannot sample"):
        s(HeadOutput.of_split(logits[[0]], logits[[1]].argmax(-1), [1]), [rows[0], unseeded])


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


def test_rows_sampled_in_runs_give_what_one_call_gives(monkeypatch):
    """Past SAMPLE_BYTES of rows that copy their logits, a call samples runs of rows one
    after the other: the same tokens (unseeded rows too: their seeds are drawn in row
    order either way), logprobs with their top lists padded to the widest, and failures
    at the step's own row indices."""
    from swaserve.sampling import sampler as sampler_mod
    from swaserve.sampling.output import SamplerOutput

    logits = fixed_logits(9, seed=17)
    kinds = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=4, seed=1),
             SamplingParams(temperature=0), SamplingParams(temperature=1.1),
             SamplingParams(temperature=0.6, top_k=20), SamplingParams(temperature=0, logprobs=1),
             SamplingParams(temperature=0.9, min_p=0.1, seed=8),
             SamplingParams(temperature=1.0, logprobs=2), SamplingParams(temperature=0.7, top_p=0.8),
             SamplingParams(temperature=0.5, frequency_penalty=0.5)]
    rows = [row(p, pos=3 + i, out=(5, 6)) for i, p in enumerate(kinds)]
    whole = make_sampler("torch", seed=9)(logits.clone(), rows)
    monkeypatch.setattr(sampler_mod, "SAMPLE_BYTES", 2 * V * 4)  # runs of 2 rows
    runs = make_sampler("torch", seed=9)(logits.clone(), rows)
    assert torch.equal(runs.tokens, whole.tokens)
    assert runs.logprob_rows == whole.logprob_rows == [0, 4, 6]
    assert torch.equal(runs.chosen_logprob, whole.chosen_logprob)
    for k, i in enumerate(runs.logprob_rows):  # each row's own n (readers slice theirs)
        n = rows[i].params.logprobs
        assert torch.equal(runs.top_ids[k, :n], whole.top_ids[k, :n])
        assert torch.equal(runs.top_logprobs[k, :n], whole.top_logprobs[k, :n])
    parts = [SamplerOutput(torch.tensor([1, 2]), None, None, None, [], {1: ValueError()}),
             SamplerOutput(torch.tensor([3]), None, None, None, [], {0: KeyError()})]
    assert sorted(SamplerOutput.cat(parts, torch.device("cpu")).failed) == [1, 2]


def test_a_row_with_a_nan_logit_gets_a_token_in_range():
    """A broken row (a NaN logit) still gets an id of the vocabulary, seeded or not, at any
    temperature, and the other rows of its batch keep their own tokens."""
    logits = fixed_logits(3, seed=2)
    logits[1, 17] = float("nan")
    rows = [row(SamplingParams(temperature=0.9, seed=4)), row(SamplingParams(temperature=1.0)),
            row(SamplingParams(temperature=0.8, seed=5))]
    got = make_sampler("torch")(logits.clone(), rows).tokens
    assert 0 <= int(got[1]) < V
    for i in (0, 2):
        assert got[i].item() == _hashed_reference(logits[i], rows[i])
    nucleus = [row(SamplingParams(temperature=1.0, top_p=0.9, seed=6 + i)) for i in range(3)]
    got = make_sampler("torch")(logits.clone(), nucleus).tokens  # the NaN row: not the kernel's
    assert 0 <= int(got[1]) < V
    for i in (0, 2):
        assert got[i].item() == _sorted_reference(logits[i], nucleus[i].params, nucleus[i])
