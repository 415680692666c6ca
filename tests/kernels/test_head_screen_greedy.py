"""The LM head's int8 screen (kernels/screen.py, screen.c) for greedy rows: a row's token
from it is q8_dpbf16's argmax, bit for bit, whatever the rows: outlier channels, exact
ties (the first column wins), crowds of near-ties, rows past the candidate cap, zero
rows, and values that are not finite (then the caller's kernel decides); where it runs,
what its copy takes, and when it gives up. Keyed rows: test_head_screen_keyed.py; in an
engine: test_head_screen_engine.py."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8, screen
from swaserve.kernels.q8_weight import Q8Weight
from tests.kernels.conftest import built_screen, hidden_rows, random_head

pytestmark = pytest.mark.skipif(not screen.available(),
                                reason="no AVX-512 VNNI and BF16 without AMX (or no compiler)")


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
