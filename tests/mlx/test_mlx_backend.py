"""The MLX backend (device="mlx") against the torch backend, float32, tiny random models:
a hybrid Gemma 3, an all-sliding Gemma 3, a Llama and a gpt-oss with sinks and MoE. Every
sampled logits row of a prompt longer than 3 W with chunked prefill (chunk 7), 32 greedy
tokens, continuous batching of mixed lengths, a prefix hit and n > 1 forks (the KV moves
the KVCache makes outside a forward, replayed on the MLX arrays). Runs on MLX's CPU build
(`mlx[cpu]`) here; skipped with the reason where mlx cannot be imported."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.engine import Engine
from swaserve.mlx import available
from swaserve.sampling.params import SamplingParams
from tests.conftest import HYBRID, TINY_WINDOW, drive, random_prompt, write_tiny_gemma3
from tests.conftest import run_logging_logits as _run

pytestmark = pytest.mark.skipif(not available(), reason="mlx is not installed "
                                "(pip install \"mlx[cpu]\" on Linux, mlx on Apple silicon)")
W = TINY_WINDOW
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlx_hybrid")
    write_tiny_gemma3(path, HYBRID, seed=21, num_heads=4, num_kv_heads=2)
    return str(path)


@pytest.fixture(scope="module")
def all_sliding(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlx_sliding")
    write_tiny_gemma3(path, ["sliding_attention"] * 3, seed=22)
    return str(path)


def _engine(path, device, **kw):
    kw.setdefault("max_model_len", 512)
    return Engine(model=path, dtype="float32", device=device, kv_memory="64MiB",
                  chunk_size=7, **kw)


def _same(path, prompts, params=GREEDY, **kw):
    """Both backends give the same tokens and, row for row, the same logits (1e-4)."""
    t1, l1 = _run(_engine(path, "cpu", **kw), prompts, params)
    t2, l2 = _run(_engine(path, "mlx", **kw), prompts, params)
    assert t1 == t2
    assert sum(len(a) for a in l1) > 0
    for a, b in zip(l1, l2):
        assert [p for p, _ in a] == [p for p, _ in b]
        for (_, x), (_, y) in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def _prompts():
    return [random_prompt(3 * W + 5, 1), random_prompt(4, 2), random_prompt(W + 1, 3)]


def test_hybrid_gemma3_mixed_batch_long_prompt(hybrid):
    _same(hybrid, _prompts())


def test_all_sliding_gemma3(all_sliding):
    _same(all_sliding, _prompts())


def test_llama(llama):
    _same(llama[0], _prompts())


def test_gpt_oss_sinks_and_moe(gpt_oss):
    _same(gpt_oss[0], _prompts())


def test_prefix_hit_and_forks_replay_kv_moves(hybrid):
    """A second request sharing a 40-token prefix starts from the cache (window pages
    copied into its ring) and n = 3 forks copy a partial page and the rings: the MLX
    arrays get the same moves, so logits match the torch backend's."""
    base = random_prompt(40, 5)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=3, ignore_eos=True)
    for device in ("cpu", "mlx"):
        eng = _engine(hybrid, device, prefix_cache=True, page_size=4)
        _run(eng, [base + random_prompt(3, 6)], GREEDY)
        toks, logs = _run(eng, [base + random_prompt(5, 7)], seeded)
        assert eng.cache.prefix.hit_tokens >= 36
        if device == "cpu":
            ref = (toks, logs)
    assert toks == ref[0]
    for a, b in zip(ref[1], logs):
        for (_, x), (_, y) in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_prompt_logprobs_match(hybrid):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outs = []
    for device in ("cpu", "mlx"):
        eng = _engine(hybrid, device)
        req = eng.add_request(random_prompt(3 * W, 9), params)[0]
        drive(eng)
        outs.append(req.prompt_logprobs)
    assert len(outs[0]) == len(outs[1]) > 1
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t] - b[t]) < 1e-4


def test_overlap_and_speculative_give_the_plain_tokens(hybrid):
    """Overlap (the forward on the worker thread, on its own MLX stream) and n-gram drafts
    (a repetitive prompt, so drafts are taken) give the torch backend's greedy tokens."""
    prompts = [random_prompt(6, 1) * 6, random_prompt(9, 2)]
    ref, _ = _run(_engine(hybrid, "cpu"), prompts, GREEDY)
    for kw in ({"overlap": True}, {"speculative": "ngram"}):
        eng = _engine(hybrid, "mlx", **kw)
        assert _run(eng, prompts, GREEDY)[0] == ref, kw
    assert eng.stats().draft_tokens[1] > 0  # drafts were accepted


def test_unsupported_options_fail_clearly(hybrid):
    with pytest.raises(ValueError, match="mlx does not support batch_invariant"):
        _engine(hybrid, "mlx", batch_invariant=True)


@pytest.mark.slow
def test_bundled_model_answers_on_mlx():
    """The bundled Gemma 3 270M (bf16) on device="mlx" through the offline API: France's
    capital in a few greedy tokens, and the first tokens the torch backend gives (bf16
    matmuls round differently between the backends, so only the start is compared). Its
    Q8_0 / Q5_0 / Q4_K weights go through MLX's quantized matmul, the Q6_K ones dense."""
    from swaserve.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=6)
    llms = {d: LLM(device=d) for d in ("mlx", "cpu")}
    quant = llms["mlx"].engine.model.quant
    assert "lm_head" in quant and len(quant) > 60, sorted(quant)
    texts = [llm.generate(["The capital of France is"], params)[0].outputs[0].text
             for llm in llms.values()]
    assert "Paris" in texts[0] or "capital" in texts[0]
    assert texts[0].split()[:3] == texts[1].split()[:3]


def test_both_backends_have_every_member_of_the_backend_protocol():
    from swaserve.engine.backend import Backend, TorchBackend
    from swaserve.mlx.backend import MLXBackend

    members = {m for m in vars(Backend) if not m.startswith("_")} | set(Backend.__annotations__)
    assert members == {"kv_device", "torch_threads", "prepare", "host_device", "model",
                       "sampler", "to_host", "end_step", "overlaps_by_default"}
    for cls in (TorchBackend, MLXBackend):
        assert all(hasattr(cls, m) for m in members), cls
