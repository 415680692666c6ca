"""The LM head's int8 screen (kernels/screen.py, screen.c): a greedy row's token from it is
q8_dpbf16's argmax, bit for bit, whatever the rows: outlier channels, exact ties (the first
column wins), crowds of near-ties, rows past the candidate cap, zero rows, and values that
are not finite (then the caller's kernel decides)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.kernels import q8, screen
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import drive

pytestmark = pytest.mark.skipif(not screen.available(),
                                reason="no AVX-512 VNNI and BF16 without AMX (or no compiler)")


def random_head(n: int, k: int, seed: int, offsets: bool = False, group: int = 32):
    """A tiled int8 head of random Q8_0-like columns (or Q4_K-like ones with offsets, or
    Q6_K's groups of 16), its columns' scales spread over 30x like a real head's."""
    g = torch.Generator().manual_seed(seed)
    if offsets:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 29 + 1) * 1e-3
    scales = scales.half().float()  # exact in float16, as a GGUF's are
    offs = torch.rand(n, k // group, generator=g) * 0.01 if offsets else None
    return Q8Weight(q, scales, offs, group=group).to_tiles()


def hidden_rows(m: int, k: int, seed: int, outliers: int = 8) -> torch.Tensor:
    """bf16 rows with a few channels 5-20x larger than the rest, as a final hidden state's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    big = torch.randperm(k, generator=g)[:outliers]
    x[:, big] *= torch.rand(outliers, generator=g) * 15 + 5
    return x.bfloat16()


def built_screen(head, k: int) -> screen.HeadScreen:
    s = screen.HeadScreen.for_head(head)
    assert s is not None and not s.built
    assert s.argmax(hidden_rows(screen.BUILD_ROWS, k, seed=99)) is not None and s.built
    return s


@pytest.mark.parametrize("offsets,group", [(False, 32), (True, 32), (False, 16)])
def test_tokens_are_q8_dpbf16s_argmaxes(offsets, group):
    n, k = 4096, 256
    head = random_head(n, k, seed=1, offsets=offsets, group=group)
    s = built_screen(head, k)
    for m in (1, 5, 17, 40):
        x = hidden_rows(m, k, seed=m)
        want = head.argmax(x, "dpbf16")
        assert torch.equal(s.argmax(x), want)
        cand, count = s.candidates(x)
        assert (count > 0).all() and count.float().median() < n / 16  # a screen
        for i in range(m):
            assert int(want[i]) in cand[i, :count[i]].tolist()


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


def test_an_exact_tie_goes_to_the_first_column_and_near_ties_are_rescored():
    """Columns copied from each row's winner (a tie: the first of them wins) and copies
    one quantum off (near-ties the screen cannot tell apart): q8_dpbf16's token still."""
    n, k = 2048, 256
    head = random_head(n, k, seed=2)
    x = hidden_rows(24, k, seed=3)
    winners = head.argmax(x, "dpbf16").tolist()
    q, scales, _ = head.rows()
    q, scales = q.clone(), scales.clone()
    g = torch.Generator().manual_seed(4)
    free = [c for c in torch.randperm(n, generator=g).tolist() if c not in winners]
    for i, w in enumerate(winners):
        twin, *near = free[i * 6:(i + 1) * 6]
        q[twin], scales[twin] = q[w], scales[w]  # the same sums exactly
        for c in near:
            q[c], scales[c] = q[w], scales[w]
            j = int(torch.randint(k, (1,), generator=g))
            q[c, j] = q[c, j] + (1 if q[c, j] < 127 else -1)
    head = Q8Weight(q, scales).to_tiles()
    s = built_screen(head, k)
    want = head.argmax(x, "dpbf16")
    assert torch.equal(s.argmax(x), want)
    sums = head.matmul(x, kernel="dpbf16")
    for i in range(x.shape[0]):  # ties are real: the first of the equal columns was taken
        best = sums[i].max()
        assert int(want[i]) == int((sums[i] == best).nonzero()[0])


def test_rows_past_the_cap_take_the_whole_head(monkeypatch):
    n, k = 2048, 128
    head = random_head(n, k, seed=5)
    s = built_screen(head, k)
    monkeypatch.setattr(screen, "CAP", 2)
    x = hidden_rows(20, k, seed=6)
    x[3] = 0  # every column ties at 0: all are candidates, the first wins
    cand, count = s.candidates(x)
    assert (count == -1).any() and (count > 0).any()
    tokens = s.argmax(x)
    assert torch.equal(tokens, head.argmax(x, "dpbf16")) and int(tokens[3]) == 0


def test_nothing_before_its_rows_are_seen_and_not_finite_values_go_back():
    n, k = 1024, 128
    head = random_head(n, k, seed=7)
    s = screen.HeadScreen.for_head(head)
    half = hidden_rows(screen.BUILD_ROWS // 2, k, seed=8)
    assert s.argmax(half) is None and not s.built
    assert torch.equal(s.argmax(half), head.argmax(half, "dpbf16")) and s.built
    x = hidden_rows(6, k, seed=9)
    x[2, 5] = float("nan")
    assert s.argmax(x) is None and head.argmax(x, "dpbf16") is None  # the logits path
    for value in (float("inf"), 2.0 ** 70):  # past what the screen's sums hold too
        x[2, 5] = value
        assert s.argmax(x) is None


def test_a_head_with_a_weight_that_is_not_finite_is_not_screened():
    n, k = 1024, 128
    q, scales, _ = random_head(n, k, seed=10).rows()
    scales = scales.clone()
    scales[77, 1] = float("inf")
    s = screen.HeadScreen.for_head(Q8Weight(q, scales).to_tiles())
    x = hidden_rows(screen.BUILD_ROWS, k, seed=11)
    assert s.argmax(x) is None and not s.built
    assert s.argmax(x) is None and s._failed  # not tried again


def test_a_copy_that_cannot_be_made_leaves_the_head_whole(monkeypatch):
    n, k = 1024, 128
    head = random_head(n, k, seed=15)
    s = screen.HeadScreen.for_head(head)
    with pytest.raises(ValueError, match="bf16"):
        s.argmax(hidden_rows(4, k, seed=16).float())

    def no_memory(*args, **kw):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(screen.torch, "empty", no_memory)
    x = hidden_rows(screen.BUILD_ROWS, k, seed=17)
    assert s.argmax(x) is None and s._failed and not s.built


def test_pending_bytes_are_the_copy_it_makes_and_the_planner_leaves_them_out(monkeypatch):
    """Before its copy the screen says what the copy will take, to the byte; the KV
    planner's `mem_fraction` budget comes out of free memory less that; once built, or
    after a failed build, nothing is pending."""
    from swaserve.config import EngineConfig
    from swaserve.memory import planner
    from swaserve.memory.layout import CacheLayout, LayerKind, LayerSpec

    n, k = 1024, 128
    s = screen.HeadScreen.for_head(random_head(n, k, seed=21))
    pending = s.pending_bytes
    assert pending > n * k
    assert s.argmax(hidden_rows(screen.BUILD_ROWS, k, seed=22)) is not None and s.built
    assert sum(t.numel() * t.element_size() for t in s._copy) == pending
    assert s.pending_bytes == 0
    layout = CacheLayout((LayerSpec(LayerKind.FULL, 1, 64),) * 2)
    monkeypatch.setattr(planner, "_free_memory_bytes", lambda device: 1 << 30)
    config = EngineConfig(mem_fraction=0.5, prefix_cache=False)
    plans = [planner.plan_kv(config, layout, 1024, torch.device("cpu"), False, reserved)
             for reserved in (0, 168 << 20)]
    assert plans[0].budget_bytes == 1 << 29
    assert plans[1].budget_bytes == ((1 << 30) - (168 << 20)) // 2
    failed = screen.HeadScreen.for_head(random_head(n, k, seed=21))
    monkeypatch.setattr(screen.torch, "empty", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("not enough memory")))
    assert failed.argmax(hidden_rows(screen.BUILD_ROWS, k, seed=23)) is None
    assert failed.pending_bytes == 0


def test_group_edges():
    assert screen.group_edges(640) == [0, 16, 64, 256, 640]
    assert screen.group_edges(64) == [0, 16, 32, 48, 64]
    assert screen.group_edges(32) == [0, 16, 32]
    edges = screen.group_edges(2880)
    assert edges[0] == 0 and edges[-1] == 2880 and all(e % 16 == 0 for e in edges)
    assert all(a < b for a, b in zip(edges, edges[1:]))
    assert screen.group_edges(48) is None and screen.group_edges(100) is None
    head = random_head(64, 64, seed=18)  # both entries refuse edges that do not cut k
    for bad in ([0, 16, 60], [0, 32, 16, 64], [8, 32, 64]):
        edges = torch.tensor(bad, dtype=torch.int32)
        wq, stats = torch.empty(64 * 64, dtype=torch.uint8), torch.empty(64 * 4 * 2)
        assert screen._pack_entry()(head.q.data_ptr(), head.scales.data_ptr(), 0, head.tile_flags,
                                    torch.arange(64, dtype=torch.int32).data_ptr(),
                                    edges.data_ptr(), len(bad) - 1, 64, 64, wq.data_ptr(),
                                    stats.data_ptr(), 1) == -1


def test_the_screen_runs_only_where_q8_dpbf16_would():
    head = random_head(1024, 128, seed=12)
    head.vnni_limit = q8.head_vnni_rows()
    s = screen.HeadScreen.for_head(head)
    many = hidden_rows(head.vnni_limit + 1, 128, seed=13)
    assert s.takes(many) and s.takes(many[:1], "dpbf16")  # a prompt step's rows
    assert not s.takes(many[:head.vnni_limit])  # q8_vnni's rows: other sums
    assert not s.takes(many.float())
    assert not s.takes(many[:0], "dpbf16") and s.argmax(many[:0]) is None  # no logits rows
    prompt_rows = hidden_rows(q8.PROMPT_DPBF16_ROWS + 1, 128, seed=14)
    assert not s.takes(prompt_rows, "dpbf16")  # q8_dpbf16 takes no more: bf16 does
    assert screen.HeadScreen.for_head(random_head(1008, 128, seed=1)) is None  # n % 32


def run_engine(path, screen_on: bool, params_of=None):
    """A bf16 engine with an int8 head: a long prompt alone first (its chunks before the
    last give the head no rows), then 20 rows (the head on q8_dpbf16), greedy unless
    `params_of(i)` says otherwise; (each request's tokens, the engine)."""
    from swaserve.engine.engine import Engine
    from swaserve.sampling.params import SamplingParams
    from tests.conftest import HYBRID, int8_copy, random_prompt, write_tiny_gemma3

    write_tiny_gemma3(path, HYBRID, seed=14)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params_of = params_of or (lambda i: greedy)
    eng = Engine(model=str(path), dtype="bfloat16", kv_memory="64MiB", max_running_requests=20,
                 max_model_len=64, prefix_cache=False, chunk_size=16)
    eng.model.use_q8({"lm_head": int8_copy(eng.model.embed)}, head_screen=screen_on)
    reqs = [eng.add_request(random_prompt(40, 99), greedy)[0]]
    drive(eng)
    reqs += [eng.add_request(random_prompt(4 + i, i), params_of(i))[0] for i in range(20)]
    drive(eng)
    return [r.output_token_ids for r in reqs], eng


def run_greedy(path, screen_on: bool):
    return run_engine(path, screen_on)


def test_a_greedy_engine_batch_gets_the_same_tokens_with_and_without_the_screen(tmp_path):
    on, eng = run_greedy(tmp_path, True)
    assert eng.model.head.screen.calls > 0
    off, eng = run_greedy(tmp_path, False)
    assert eng.model.head.screen is None and on == off


def test_a_sampling_engine_batch_gets_the_same_tokens_with_and_without_the_screen(tmp_path):
    """Greedy rows beside keyed temperature rows (seeded and not: the engine's generator
    seeds them the same way in both runs) and rows that need logits (top-p, logprobs, a
    penalty): every request's tokens are the same with the screen drawing the keyed
    rows as with whole logits."""
    from swaserve.sampling.params import SamplingParams

    def params_of(i):
        kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, seed=i),
                 dict(temperature=1.5), dict(temperature=1.0, top_p=0.9),
                 dict(temperature=0.7, logprobs=2), dict(temperature=1.0, presence_penalty=0.5)]
        return SamplingParams(max_tokens=12, ignore_eos=True, **kinds[i % len(kinds)])

    on, eng = run_engine(tmp_path, True, params_of)
    assert eng.model.head.screen.drawn > 0
    off, eng = run_engine(tmp_path, False, params_of)
    assert eng.model.head.screen is None and on == off


def test_a_screen_that_raises_is_turned_off_and_the_step_goes_on(tmp_path, monkeypatch,
                                                                  caplog):
    want, _ = run_greedy(tmp_path, False)

    def broken(self, x, *keys):
        raise RuntimeError("injected")

    monkeypatch.setattr(screen.HeadScreen, "tokens", broken)
    got, eng = run_greedy(tmp_path, True)
    assert got == want and eng.model.head.screen is None
    assert "LM head screen failed" in caplog.text

def test_the_bound_holds_where_rounding_errs_all_one_way():
    """Every small input of each group just under a half step from its int8 value, so the
    screen undervalues the column that sums them (A) by nearly the whole bound and
    overvalues one that subtracts them (B): B screens above A, A is the argmax, and the
    screen must still keep A (with SLACK at 0.3 instead of 0.52 it drops A)."""
    k, n, a, b = 64, 64, 5, 9
    sx = 1 / 8
    x = torch.full((1, k), 2.46875 * sx)  # 79/32: exact in bf16, rounds to 2
    x[0, ::16] = 127 * sx  # each group's largest input sets its scale
    q = torch.zeros(n, k, dtype=torch.int8)
    q[a] = 127
    q[b] = -127
    q[b, ::16] = 127
    scales = torch.full((n, k // 32), 2.0 ** -10)
    ratio = 163.90625 / 90.09375  # B's scale so that its sum is just under A's
    scales[b] = torch.tensor(2.0 ** -10 * ratio * 0.995).half().float()
    head = Q8Weight(q, scales).to_tiles()
    s = screen.HeadScreen.for_head(head)
    seen = torch.arange(k, 0, -1, dtype=torch.float32).expand(screen.BUILD_ROWS, k)
    assert s.argmax(seen.bfloat16().contiguous()) is not None  # groups: channels in order
    assert torch.equal(s._copy[0], torch.arange(k, dtype=torch.int32))
    x = x.bfloat16()
    assert int(head.argmax(x, "dpbf16")[0]) == a
    w = head.dequantize().double()
    rounded = torch.round(x.double() / sx) * sx
    assert float(rounded @ w[b]) > float(rounded @ w[a])  # the screen alone would pick B
    cand, count = s.candidates(x)
    assert a in cand[0, :count[0]].tolist()
    assert int(s.argmax(x)[0]) == a


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
