"""One request's fault never reaches another: a stage made to raise for one request of a
batch of 8 fails that request only; the other 7 produce exactly the tokens they produce
without it, and the pools end fully free. A fault of a whole step fails that step's
requests with an error and the engine keeps serving."""

from __future__ import annotations

import pytest

from swaserve.engine.engine import Engine
from swaserve.engine.faults import FaultInjector, InjectedFault
from swaserve.engine.request import FinishReason
from swaserve.mlx import available as mlx_available
from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE, drive

pytest.importorskip("llguidance")
MLX = [pytest.mark.skipif(not mlx_available(), reason="mlx is not installed "
                          "(pip install \"mlx[cpu]\" on Linux)"), pytest.mark.cpu_only]


def batch_of_8(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded (filtered and not), penalties, logprobs, a stop string and two grammar
    rows: rows whose tokens are pure functions of their logits."""
    kinds = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=11, top_k=40, top_p=0.9, max_tokens=14),
             SamplingParams(temperature=0, max_tokens=14, logprobs=3, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=5, max_tokens=14, frequency_penalty=0.4),
             SamplingParams(temperature=0, max_tokens=20, regex=r"[a-z]{4,10}"),
             SamplingParams(temperature=0.9, seed=3, max_tokens=14, min_p=0.05),
             SamplingParams(temperature=1.0, seed=8, max_tokens=20, regex=r"[0-9]{2,6}"),
             SamplingParams(temperature=0, max_tokens=14, stop=["zz"], ignore_eos=True)]
    return [([3 + (i * 13 + j * 7) % (vocab - 3) for j in range(4 + 3 * i)], p)
            for i, p in enumerate(kinds)]


def run(path: str, arm: list[tuple[str, str]] = (), arm_after: int = 0,
        device: str = TEST_DEVICE, **kw) -> tuple[Engine, list]:
    """The batch, with the engine's faults armed at `arm` (stage, request id) pairs after
    `arm_after` steps. On the CPU in batch-invariant
    mode: a failed row leaves its neighbours in a smaller batch, and the CPU's BLAS rounds
    some rows of a float32 batch of 7 differently from the same rows in a batch of 8 (AMD
    Zen 5's MKL does), so only that mode can promise the very bits of the healthy run. (MLX
    refuses the mode; its kernels do not depend on the row count.)"""
    eng = Engine(model=path, dtype="float32", kv_memory="16MiB", max_running_requests=8,
                 page_size=4, chunk_size=64, device=device,
                 batch_invariant=device == "cpu", **kw)
    reqs = [eng.add_request(prompt, p, request_id=f"r{i}")[0]
            for i, (prompt, p) in enumerate(batch_of_8(eng.vocab_size))]
    steps = 0
    while eng.has_unfinished():
        if steps == arm_after:
            for stage, victim in arm:
                eng.faults.arm(stage, victim)
        eng.step()
        eng.check_integrity()
        steps += 1
        assert steps < 200
    return eng, reqs


@pytest.mark.parametrize("stage, victim, arm_after, overlap, device", [
    ("sampler", "r1", 0, False, TEST_DEVICE),  # at the prompt's first token
    ("sampler", "r5", 4, True, TEST_DEVICE),  # mid-decode, with the next step already in flight
    ("detokenizer", "r2", 3, False, TEST_DEVICE),
    ("detokenizer", "r0", 0, True, TEST_DEVICE),
    ("grammar", "r4", 2, False, TEST_DEVICE),  # the mask of one of two grammar rows
    ("grammar", "r6", 0, True, TEST_DEVICE),
    pytest.param("sampler", "r1", 0, False, "mlx", marks=MLX),  # the MLX sampler's graph
    pytest.param("sampler", "r5", 4, True, "mlx", marks=MLX),
    pytest.param("grammar", "r4", 2, True, "mlx", marks=MLX),
])
def test_a_faulty_request_fails_alone(tiny_with_tokenizer, stage, victim, arm_after, overlap,
                                      device):
    _, clean = run(tiny_with_tokenizer, overlap=overlap, device=device)
    eng, hurt = run(tiny_with_tokenizer, [(stage, victim)], arm_after, overlap=overlap,
                    device=device)
    for a, b in zip(clean, hurt):
        if a.request_id == victim:
            assert b.finish_reason is FinishReason.ERROR
            assert f"injected {stage} fault" in b.error.message
            assert len(b.output_token_ids) <= len(a.output_token_ids)
        else:  # exactly what it produced beside a healthy neighbour
            assert b.finish_reason == a.finish_reason, b.request_id
            assert b.output_token_ids == a.output_token_ids, b.request_id
            assert b.output_text == a.output_text
            assert b.logprobs == a.logprobs
    assert eng.cache.is_fully_free()


@pytest.mark.parametrize("overlap, device", [(False, TEST_DEVICE), (True, TEST_DEVICE),
                                             pytest.param(True, "mlx", marks=MLX)])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_with_tokenizer, overlap,
                                                                 device):
    # no request can be blamed for a forward's failure
    eng, reqs = run(tiny_with_tokenizer, [("forward", "r3")], arm_after=2, overlap=overlap,
                    device=device)
    failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
    assert failed and all("engine step" in r.error.message for r in failed)
    assert any(r.request_id == "r3" for r in failed)
    eng.check_integrity()
    assert eng.cache.is_fully_free()
    # the engine still serves, and exactly as a fresh one does
    eng.faults.disarm()
    prompt, params = batch_of_8(eng.vocab_size)[2]
    again = eng.add_request(prompt, params, request_id="after")[0]
    drive(eng)
    _, fresh = run(tiny_with_tokenizer, overlap=overlap, device=device)
    assert again.output_token_ids == fresh[2].output_token_ids
    assert eng.cache.is_fully_free()


def test_the_offline_api_reports_the_failed_request(tiny_with_tokenizer):
    from swaserve import LLM

    llm = LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, kv_memory="16MiB",
              max_running_requests=4)
    llm.engine.faults.arm("sampler", "req-1")
    outs = llm.generate([[5, 6, 7], [8, 9, 10], [11, 12]],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "injected sampler fault" in outs[1].outputs[0].error
    assert len(outs[0].token_ids) == len(outs[2].token_ids) == 6


def test_fault_injector_names_its_stages():
    with pytest.raises(ValueError, match="stage"):
        FaultInjector().arm("tokenizer", "x")
    f = FaultInjector()
    f.arm("sampler", "a")
    f.check("sampler", ["b"])
    with pytest.raises(InjectedFault, match="a"):
        f.check("sampler", ["b", "a"])


def test_rows_without_a_seed_keep_their_tokens_when_a_neighbour_fails_the_sampler():
    """Rows that sample without a seed are seeded when the step's rows are built
    (`SampleStage.rows` keys them), so when one row's sampling raises and the batch is
    redone row by row, every other row gets the token the whole batch would have given it,
    at T = 1, with top-p and beside greedy rows."""
    import torch

    from swaserve.engine.request import Request
    from swaserve.engine.sample_stage import SampleStage
    from swaserve.engine.scheduler import ScheduledSeq
    from swaserve.sampling.sampler import Sampler

    vocab = 500
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0)]
    reqs = [Request(f"q{i}", [1, 2], SamplingParams(**kinds[i % 3]), 64) for i in range(9)]
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(4)) * 2
    stage = SampleStage(Sampler(vocab, torch.device("cpu"), seed=3), vocab,
                        torch.device("cpu"), frozenset(), FaultInjector())
    rows, owners, failed = stage.rows([ScheduledSeq(r, 0, 2, True) for r in reqs])
    assert not failed and [r for _, r in owners] == reqs
    assert all(r.seed is not None for r in rows if not r.params.greedy)
    whole = stage.sample(logits.clone(), rows, owners).tokens
    stage.faults.arm("sampler", "q4")
    hurt = stage.sample(logits.clone(), rows, owners)
    assert set(hurt.failed) == {4}
    for i in range(9):
        if i != 4:
            assert int(hurt.tokens[i]) == int(whole[i]), i
