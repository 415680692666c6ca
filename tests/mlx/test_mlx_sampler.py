"""The MLX sampler (mlx/sampler.py) against the torch sampler on identical logits: the
murmur noise bit for bit, the same tokens for seeded rows whatever their parameters, the
same logprobs, and one `mx.eval` a step for the forward and the sampling together. The
contract tests both samplers share (chi-square of the filtered distributions, batch
independence, penalties, logprobs, the full-sort fallback) are in
tests/sampling/test_sampler_*.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import murmur
from swaserve.mlx import available
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.rows import SamplerRow
from swaserve.sampling.sampler import Sampler
from tests.conftest import HYBRID, drive, random_prompt, write_tiny_gemma3

pytestmark = pytest.mark.skipif(not available(), reason="mlx is not installed "
                                "(pip install \"mlx[cpu]\" on Linux, mlx on Apple silicon)")


def _mx():
    import mlx.core as mx
    return mx


def _prefix(seeds, positions) -> torch.Tensor:
    lo_hi = [murmur.split_seed(s) for s in seeds]
    return murmur.row_prefix(torch.tensor([x[0] for x in lo_hi]), torch.tensor([x[1] for x in lo_hi]),
                             torch.tensor(positions))


def test_murmur_hash_bit_identical_and_gumbel_to_the_last_bit_of_a_score():
    from swaserve.mlx import sampler as mlx_sampler

    mx = _mx()
    g = torch.Generator().manual_seed(0)
    seeds = [0, 1, 2**31, 2**63 + 12345] + torch.randint(0, 2**62, (12,), generator=g).tolist()
    prefix = _prefix(seeds, torch.randint(0, 2**20, (16,), generator=g).tolist())
    tokens = torch.cat([torch.tensor([0, 1, 262143]), torch.randint(0, 262144, (4000,), generator=g)])
    want = murmur.murmur_hash(prefix, tokens)
    got = mlx_sampler.murmur_hash(mx.array(prefix.numpy()), mx.array(tokens.numpy()))
    assert np.array_equal(np.array(got).astype(np.int64), want.numpy())
    ends = torch.tensor([[0, 1, 0xFFFFFFFF, 0xFFFFFFFE]])
    h = torch.cat([want, ends.expand(16, 4)], dim=1)
    g_t = murmur.gumbel_from_hash(h).numpy()
    with mx.stream(mx.cpu):
        g_m = np.array(mlx_sampler.gumbel_from_hash(mx.array(h.numpy().astype(np.uint32))))
    assert g_m.dtype == np.float64
    finite = np.isfinite(g_t)
    assert np.array_equal(finite, np.isfinite(g_m)) and np.all(g_m[~finite] == -np.inf)
    # MLX's float64 log is not always correctly rounded: a last-bit difference in -log u
    # is an absolute 1e-16 or so in the noise, below the last bit of a score x + g with |x| >= 1
    err = np.abs(g_m[finite] - g_t[finite]) / np.spacing(np.maximum(np.abs(g_t[finite]), 1.0))
    assert err.max() <= 1, err.max()
    assert (g_m == g_t).mean() > 0.99


def _mixed_rows(v: int, seed: int) -> list[SamplerRow]:
    """Every kind of sampling row, seeded: each filter tier, edits, penalties, logprobs."""
    mask = torch.zeros(v)
    mask[torch.randperm(v, generator=torch.Generator().manual_seed(seed))[: v // 3]] = float("-inf")
    P = SamplingParams
    params = [P(temperature=0), P(temperature=0, logit_bias={5: 3.0}, logprobs=3),
              P(temperature=0.8), P(temperature=1.3, logprobs=0), P(temperature=1.0, top_k=40),
              P(temperature=1.0, top_k=2000, top_p=0.99),  # the 8,192 tier
              P(temperature=0.9, top_k=9000, top_p=0.98),  # the whole vocabulary
              P(temperature=1.0, top_p=0.9), P(temperature=1.0, top_p=0.95, logprobs=5),
              P(temperature=1.0, min_p=0.01), P(temperature=0.7, top_p=0.8, min_p=0.02),
              P(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.3,
                repetition_penalty=1.2, top_p=0.9),
              P(temperature=1.0, logit_bias={7: 5.0, 11: -100.0}, top_k=50),
              P(temperature=1.0, top_p=0.9), P(temperature=1.0)]
    rows = []
    for i, p in enumerate(params):
        r = SamplerRow(p, 1000 * seed + i, 20 + i, [1, 2, 3, 7], [3, 3, 9, 12][: i % 5],
                       suppress=[4] if i % 4 == 1 else ())
        if i in (4, 9, 12):
            r.grammar_bias = mask
        rows.append(r)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_tokens_and_logprobs_as_the_torch_sampler(seed):
    """V = 12,000: the 1,024 / 8,192 / whole-vocabulary tiers; the last rows are flat, so
    their nucleus passes 8,192 and they are drawn again after the eval."""
    from swaserve.mlx.cache import to_mx
    from swaserve.mlx.sampler import MLXSampler
    from swaserve.mlx.step import StepGraph

    v = 12000
    rows = _mixed_rows(v, seed)
    logits = torch.randn(len(rows), v, generator=torch.Generator().manual_seed(seed)) * 3
    logits[-3:] *= 0.01  # flat
    want = Sampler(v, torch.device("cpu"))(logits.clone(), rows)
    got = MLXSampler(v, StepGraph())(to_mx(logits), rows)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.logprob_rows == want.logprob_rows
    torch.testing.assert_close(got.chosen_logprob, want.chosen_logprob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.top_ids, want.top_ids)


def test_one_eval_a_step_for_forward_and_sampling(tmp_path, monkeypatch):
    """A step's forward, KV writes and sampling (every kind of row whose kept set fits the
    bounded candidates) are one `mx.eval`; the tokens equal the torch backend's."""
    from swaserve.engine.engine import Engine

    write_tiny_gemma3(tmp_path, HYBRID, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=4, max_tokens=6,
                             ignore_eos=True, frequency_penalty=0.5)]
    prompts = [random_prompt(n, i) for i, n in enumerate((30, 9, 17))]

    def run(device):
        eng = Engine(model=str(tmp_path), dtype="float32", device=device, kv_memory="32MiB",
                     chunk_size=16, max_model_len=256)
        reqs = [eng.add_request(p, q)[0] for p, q in zip(prompts, params)]
        evals = []
        if device == "mlx":
            mx = _mx()
            real = mx.eval
            monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(1), real(*a))[1])
        steps = drive(eng)
        monkeypatch.undo()
        return [r.output_token_ids for r in reqs], steps, len(evals)

    want, _, _ = run("cpu")
    got, steps, evals = run("mlx")
    assert got == want
    assert evals == steps


def test_grammar_stop_and_n_rows_equal_the_torch_backend(tiny_with_tokenizer):
    """Rows that need their token on the host (a JSON schema, a stop string, penalties,
    n > 1 forks) on the MLX backend, with overlap: the torch backend's text."""
    import json

    from swaserve.engine.engine import Engine

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=1.0, seed=5, max_tokens=40, json_schema=schema),
              SamplingParams(temperature=0.9, seed=6, max_tokens=30, stop=["a"], top_p=0.9),
              SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=3, min_p=0.05,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=12)]

    def run(device, **kw):
        eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=device,
                     kv_memory="32MiB", max_model_len=256, **kw)
        reqs = [r for i, p in enumerate(params) for r in eng.add_request(f"hello {i}", p)]
        drive(eng)
        return [(r.output_token_ids, r.finish_reason) for r in reqs], eng

    want, eng = run("cpu")
    got, _ = run("mlx", overlap=True)
    assert got == want
    json.loads(eng.tokenizer.decode(want[0][0]))  # the schema row is valid JSON


def _faulty_eval(monkeypatch, fail):
    """mx.eval raising while `fail(args)` says so."""
    mx = _mx()
    real = mx.eval

    def ev(*a):
        if fail(a):
            raise RuntimeError("[metal] Insufficient Memory (injected)")
        return real(*a)
    monkeypatch.setattr(mx, "eval", ev)


def test_a_failed_sampling_eval_costs_nothing(hybrid_path, monkeypatch):
    """A step's joint eval fails once (the sampler's part; the forward alone evaluates):
    the rows are sampled again one by one and every request gets its tokens."""
    prompts = [random_prompt(n, i) for i, n in enumerate((30, 9))]
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, top_p=0.9)
    want = _run_mlx(hybrid_path, prompts, p)
    calls = {"n": 0}

    def once(args):
        calls["n"] += 1
        return calls["n"] == 3
    _faulty_eval(monkeypatch, once)
    assert _run_mlx(hybrid_path, prompts, p) == want


def test_a_failed_forward_eval_resets_the_kv_and_the_engine_serves_on(hybrid_path, monkeypatch):
    """A forward whose eval fails leaves the lazily written KV arrays unusable: every
    request holding KV fails with a clear error, the prefix cache is emptied, the pools are
    whole, and the next requests get the tokens a fresh engine gives."""
    from swaserve.engine.engine import Engine
    from swaserve.engine.request import FinishReason

    eng = Engine(model=hybrid_path, dtype="float32", device="mlx", kv_memory="32MiB",
                 chunk_size=16, max_model_len=256)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = [eng.add_request(random_prompt(n, i), p)[0] for i, n in enumerate((40, 12))]
    eng.step()
    eng.step()
    state = {"armed": True}
    _faulty_eval(monkeypatch, lambda a: state["armed"])
    eng.step()
    state["armed"] = False
    assert all(r.finish_reason is FinishReason.ERROR for r in first)
    assert "KV data is reset" in str(first[0].error)
    eng.check_integrity()
    prompts = [random_prompt(n, 10 + i) for i, n in enumerate((40, 7))]
    again = [eng.add_request(q, p)[0] for q in prompts]
    drive(eng)
    assert [r.output_token_ids for r in again] == _run_mlx(hybrid_path, prompts, p)


def _run_mlx(path, prompts, params):
    from swaserve.engine.engine import Engine

    eng = Engine(model=path, dtype="float32", device="mlx", kv_memory="32MiB",
                 chunk_size=16, max_model_len=256)
    reqs = [eng.add_request(q, params)[0] for q in prompts]
    drive(eng)
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlx_sampler_hybrid")
    write_tiny_gemma3(path, HYBRID, seed=5)
    return str(path)


def test_the_server_on_mlx_answers_the_openai_client_like_cpu(tiny_with_tokenizer):
    """The OpenAI server over an MLX engine (its engine thread makes its own MLX streams):
    concurrent seeded completions, streamed and not, with logprobs, and a bad request
    beside them that gets a 400 and costs them nothing; the text equals the cpu server's."""
    import asyncio

    import openai

    from tests.conftest import inprocess_app, run_client

    async def ask(client, http):
        kw = {"model": "tiny", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}
        calls = [client.completions.create(prompt=f"hello {i}", seed=i, logprobs=2, **kw)
                 for i in range(4)]
        calls.append(client.completions.create(prompt="hello", seed=9, stream=True, **kw))
        calls.append(client.completions.create(prompt="hello", top_p=7.0, model="tiny"))
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(got[-1], openai.BadRequestError) and "top_p" in str(got[-1])
        streamed = "".join([c.choices[0].text async for c in got[4]])
        return [r.choices[0].text for r in got[:4]] + [streamed]

    texts = {}
    for device in ("cpu", "mlx"):
        apps = inprocess_app(tiny_with_tokenizer, device=device, kv_memory="16MiB",
                             max_model_len=256)
        app = next(apps)
        texts[device] = run_client(app, ask)
        next(apps, None)  # shuts it down and checks its memory is whole
    assert texts["mlx"] == texts["cpu"] and all(texts["cpu"])
