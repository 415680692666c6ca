"""The LM head's int8 screen for keyed sampling rows: each row it settles gets the
sampler's token on q8_dpbf16's whole logits (the same keys), the noise bounds it reads
hold at every range's edge, and a row past the candidate cap is left to its logits;
hypothesis draws rows against the sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.kernels import screen
from tests.kernels.conftest import built_screen, hidden_rows, random_head

pytestmark = pytest.mark.skipif(not screen.available(),
                                reason="no AVX-512 VNNI and BF16 without AMX (or no compiler)")


def keyed_rows_of(m: int, seed: int, greedy_every: int = 4):
    """Sampler rows for m logits rows: every `greedy_every`-th greedy, the others keyed at
    temperatures from 0.05 to 2 (seeds and positions their own); (rows, temperature,
    prefix) as the screen takes them (0 for a greedy row)."""
    from swaserve.sampling.params import SamplingParams
    from swaserve.sampling.rows import SamplerRow, row_prefixes

    g = torch.Generator().manual_seed(seed)
    temps = (0.05, 0.3, 0.7, 1.0, 1.3, 2.0)
    rows = []
    for i in range(m):
        t = 0.0 if i % greedy_every == 0 else temps[i % len(temps)]
        rows.append(SamplerRow(SamplingParams(temperature=t), int(torch.randint(2**62, (1,), generator=g)),
                               int(torch.randint(1 << 20, (1,), generator=g)), [1], []))
    temperature = torch.tensor([float(r.params.temperature) for r in rows])
    return rows, temperature, row_prefixes(rows, torch.device("cpu"))


@pytest.mark.parametrize("offsets,group", [(False, 32), (True, 32)])
def test_keyed_rows_draw_the_samplers_tokens_from_q8_dpbf16s_logits(offsets, group):
    """Greedy and keyed sampling rows in one screen call: each keyed row's token is the one
    the sampler draws from q8_dpbf16's whole logits (and from hashing every id), each
    greedy row's the argmax; a keyed row keeps a screen's few candidates. The rows are
    scaled so that the logits spread as a real head's (std ~4): the draws are not the
    argmaxes."""
    from swaserve.kernels import murmur
    from swaserve.sampling.sampler import Sampler

    n, k = 4096, 256
    head = random_head(n, k, seed=31, offsets=offsets, group=group)
    s = built_screen(head, k)
    kept, unsettled, drawn = [], 0, 0
    for m, seed in ((1, 1), (7, 2), (24, 3), (40, 4), (40, 5)):
        x = (hidden_rows(m, k, seed=100 + seed).float() * 0.08).bfloat16()
        rows, temperature, prefix = keyed_rows_of(m, seed, greedy_every=4 if m > 1 else 2)
        if m == 1:  # one keyed row alone
            rows, temperature, prefix = keyed_rows_of(2, seed, greedy_every=2)
            rows, temperature, prefix = rows[1:], temperature[1:], prefix[1:]
        logits = head.matmul(x, kernel="dpbf16")
        want = Sampler(n, torch.device("cpu"))(logits, rows).tokens
        got = s.tokens(x, temperature, prefix)
        settled = got >= 0  # a keyed row past CAP candidates: -1 (the caller's logits)
        assert torch.equal(got[settled], want[settled]), (m, seed)
        unsettled += int((~settled).sum())
        ids = torch.arange(n)
        for i in range(m):  # hashing every id
            if temperature[i] > 0 and settled[i]:
                score = murmur.keyed_scores(logits[i], temperature[i].expand(n),
                                            prefix[i].expand(n), ids)
                assert int(got[i]) == int(score.argmax())
        cand, count = s.candidates(x, temperature, prefix)
        kept += count[temperature > 0].tolist()
        drawn += int(((got != logits.argmax(1)) & (temperature >= 0.7)).sum())
    assert drawn >= 20, drawn
    assert unsettled <= 3 and sorted(kept)[len(kept) // 2] < n / 16, (unsettled, kept)


def test_a_keyed_rows_noise_bounds_hold_at_the_edge_of_every_range():
    """The bounds on a hash's noise the screen reads (its vector code, head_screen_noise):
    at and around each power of two of h and of 2^32 - 1 - h (its ranges' edges), at the
    ends and at 200,000 random hashes, least <= murmur.py's g <= most, rising with h, and
    no range wider than 0.9 but the two ends (g under -2.4, g over 11)."""
    from swaserve.kernels import build, murmur

    edges = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    near = (torch.cat([edges, murmur.M32 - edges])[:, None] + torch.arange(-2, 3)[None, :])
    hashes = torch.cat([near.flatten().clamp(0, murmur.M32),
                        torch.randint(0, murmur.M32 + 1, (200_000,),
                                      generator=torch.Generator().manual_seed(35))])
    hashes = hashes.unique()  # sorted
    least, most = torch.empty(len(hashes)), torch.empty(len(hashes))
    assert build.function("screen", "head_screen_noise")(
        hashes.data_ptr(), len(hashes), least.data_ptr(), most.data_ptr()) == 0
    g = murmur.gumbel_from_hash(hashes)
    assert bool((least.double() <= g).all()) and bool((g <= most.double()).all())
    assert bool((least[1:] >= least[:-1]).all()) and bool((most[1:] >= most[:-1]).all())
    inner = (least > -2.5) & (most < 11.2)
    assert float((most - least)[inner].max()) < 0.9
    assert float(most.max()) >= murmur.NOISE_MAX and float(least.min()) == float("-inf")


def test_a_keyed_row_past_the_cap_is_left_to_its_logits(monkeypatch):
    n, k = 2048, 128
    head = random_head(n, k, seed=32)
    s = built_screen(head, k)
    x = hidden_rows(12, k, seed=33)
    rows, temperature, prefix = keyed_rows_of(12, 34, greedy_every=3)
    monkeypatch.setattr(screen, "CAP", 2)
    cand, count = s.candidates(x, temperature, prefix)
    over = count < 0
    assert over[temperature > 0].any() and over[temperature == 0].any()
    got = s.tokens(x, temperature, prefix)
    want = head.argmax(x, "dpbf16")
    assert torch.equal(got[temperature == 0], want[temperature == 0])
    assert (got[over & (temperature > 0)] == -1).all()
    with pytest.raises(ValueError, match="temperature is under"):
        s.tokens(x, temperature.clamp(max=screen.MIN_TEMPERATURE / 2), prefix)


@pytest.fixture(scope="module")
def fuzz_heads():
    """Two built screens: Q8_0-like columns, and Q4_K-like ones with offsets."""
    k = 256
    heads = [(h, built_screen(h, k)) for h in (random_head(4096, k, seed=7),
                                                random_head(4096, k, seed=8, offsets=True))]
    yield heads
    assert all(s.drawn >= 600 for _, s in heads), [s.drawn for _, s in heads]  # keyed rows ran


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(head=st.integers(0, 1), m=st.integers(1, 48),
       spread=st.sampled_from([0.002, 0.03, 0.08, 0.3]),
       temps=st.lists(st.sampled_from([0.0, 0.0, screen.MIN_TEMPERATURE, 0.01, 0.3, 1.0, 1.0,
                                       2.5, 100.0, 1e6]), min_size=1, max_size=48),
       ties=st.booleans(), data_seed=st.integers(0, 2**31))
def test_fuzz_screen_tokens_are_the_samplers_on_whole_logits(fuzz_heads, head, m, spread, temps,
                                                             ties, data_seed):
    """hypothesis draws the rows (how many, their spread from flat to peaked, equal rows
    whose logits tie exactly, greedy and keyed rows from MIN_TEMPERATURE to 1e6): each
    token the screen settles is the sampler's on q8_dpbf16's whole logits, with the same
    keys; a row it leaves (-1) is keyed and past CAP."""
    from swaserve.sampling.params import SamplingParams
    from swaserve.sampling.rows import SamplerRow, row_prefixes
    from swaserve.sampling.sampler import Sampler

    h, s = fuzz_heads[head]
    g = torch.Generator().manual_seed(data_seed)
    x = (hidden_rows(m, 256, seed=data_seed).float() * spread / 0.08).bfloat16()
    if ties and m > 1:
        x[m // 2:] = x[0]  # the same logits: only their keys tell them apart
    rows = [SamplerRow(SamplingParams(temperature=temps[i % len(temps)]),
                       int(torch.randint(2**62, (1,), generator=g)),
                       int(torch.randint(1 << 20, (1,), generator=g)), [1], []) for i in range(m)]
    temperature = torch.tensor([float(r.params.temperature) for r in rows])
    got = s.tokens(x, temperature, row_prefixes(rows, torch.device("cpu")))
    assert got is not None
    want = Sampler(4096, torch.device("cpu"))(h.matmul(x, kernel="dpbf16"), rows).tokens
    settled = got >= 0
    assert bool((temperature[~settled] > 0).all())
    assert torch.equal(got[settled], want[settled])
