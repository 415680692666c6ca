"""The sampler row by row: greedy rows exact and drawing nothing, a seeded row's token
whatever its batch, penalties, bias and logprobs as specified, parameters validated,
split logits and runs of rows giving what whole logits give, a NaN row kept to itself.

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
    fixed_logits,
    hashed_reference,
    make_sampler,
    row,
    sorted_reference,
)


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
        assert got[i].item() == hashed_reference(logits[i], rows[i])
    nucleus = [row(SamplingParams(temperature=1.0, top_p=0.9, seed=6 + i)) for i in range(3)]
    got = make_sampler("torch")(logits.clone(), nucleus).tokens  # the NaN row: not the kernel's
    assert 0 <= int(got[1]) < V
    for i in (0, 2):
        assert got[i].item() == sorted_reference(logits[i], nucleus[i].params, nucleus[i])
