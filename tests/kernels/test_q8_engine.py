"""An engine's int8 LM head: the model's head takes its own vnni limit, and greedy rows
(alone, or beside sampled rows) take the head's argmaxes with the tokens of the logits
path."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import Q8Weight
from tests.conftest import drive
from tests.kernels.conftest import vnni


@vnni
def test_the_models_head_takes_its_own_vnni_limit(tmp_path):
    """A model's tiled int8 head gets `head_vnni_rows()` (past `vnni_rows()` where the rows
    past it would go to q8_dpbf16), or where its screen runs at most screen.VNNI_ROWS (the
    screen's tokens are faster past them), and drafts may grow a step only within both
    limits."""
    from swaserve.engine.engine import Engine
    from swaserve.kernels import screen
    from tests.conftest import HYBRID, write_tiny_gemma3

    write_tiny_gemma3(tmp_path, HYBRID, seed=3)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256)
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    int8 = Q8Weight(torch.round(head / scales).to(torch.int8), scales).to_tiles()
    base = q8.head_vnni_rows()
    assert base >= q8.vnni_rows()
    if not q8.amx_available() and q8.dpbf16_available():
        assert base == max(q8.HEAD_VNNI_ROWS, q8.vnni_rows())
    else:
        assert base == q8.vnni_rows()
    for screened in (False, True):
        eng.model.use_q8({"lm_head": int8}, head_screen=screened)
        limit = base
        if screened and eng.model.head.screen is not None:
            limit = min(base, screen.VNNI_ROWS)
            assert limit < base or not screen.available()
        assert eng.model.head.q8.vnni_limit == limit
        assert eng.model.same_numerics_rows(1) == limit
        assert eng.model.same_numerics_rows(limit + 1) == 1 << 62


@pytest.mark.skipif(q8.tile_kernel(1) is None, reason="no tile kernel (or no compiler) here")
def test_a_greedy_batch_takes_the_heads_argmaxes_with_the_same_tokens(tmp_path, monkeypatch):
    """A bf16 engine with an int8 LM head: a batch of plain greedy rows (one row up to nine,
    so q8_vnni's rows and past them) gets its tokens from the head's argmaxes, and they are
    the tokens of the logits path (taken when logits are logged, or when a row samples)."""
    from swaserve.engine.engine import Engine
    from swaserve.sampling.params import SamplingParams
    from tests.conftest import HYBRID, random_prompt, write_tiny_gemma3

    write_tiny_gemma3(tmp_path, HYBRID, seed=9)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256,
                 prefix_cache=False)  # each run computes its prompts alike
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    q = torch.round(head / scales).to(torch.int8)
    eng.model.use_q8({"lm_head": Q8Weight(q, scales).to_tiles()})
    taken = []  # the rows of each step whose tokens came from the head's argmaxes
    real = Q8Weight.argmax

    def argmax(self, x, kernel=None):
        tokens = real(self, x, kernel)
        if tokens is not None:
            taken.append(x.shape[0])
        return tokens

    monkeypatch.setattr(Q8Weight, "argmax", argmax)
    # 4 to 20 tokens: the batch shrinks from nine rows to one as requests finish
    greedy = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(9)]
    prompts = [random_prompt(5 + 3 * i, i) for i in range(9)]

    def run(log: bool, params: list[SamplingParams]):
        eng.logits_log = [] if log else None
        reqs = [eng.add_request(p, q)[0] for p, q in zip(prompts, params)]
        drive(eng)
        return [r.output_token_ids for r in reqs]

    fast = run(False, greedy)
    assert 1 in taken and 9 in taken
    taken.clear()
    assert run(True, greedy) == fast and not taken
    seeded = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    assert run(False, [seeded] + greedy[1:])[1:] == fast[1:]
    assert taken and max(taken) < 9  # only the steps after the sampled row finished


def test_greedy_rows_beside_sampled_rows_take_argmaxes_with_the_same_tokens(tmp_path,
                                                                             monkeypatch):
    """A bf16 engine with an int8 LM head, a batch mixing plain greedy rows with seeded
    sampling, top-k and logprob rows (9 rows shrinking to 1): the greedy rows' tokens come
    from the head's argmaxes and the others' from their own logits (a SPLIT HeadOutput), each on
    the kernel the whole step's head would take (on q8_vnni's rows every row's logits, one
    pass over the head), so every request's tokens and logprobs are those of the path that
    computes every row's logits (taken when logits are logged)."""
    from swaserve.engine.engine import Engine
    from swaserve.models.head import LMHead
    from swaserve.sampling.params import SamplingParams
    from tests.conftest import HYBRID, random_prompt, write_tiny_gemma3

    if q8.tile_kernel(9) is None:
        pytest.skip("no int8 tile kernel takes 9 decode rows here")
    write_tiny_gemma3(tmp_path, HYBRID, seed=9)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256,
                 prefix_cache=False)
    head = eng.model.embed.float()
    scales = head.view(128, 1, 32).abs().amax(-1) / 127
    eng.model.use_q8({"lm_head": Q8Weight(torch.round(head / scales).to(torch.int8),
                                             scales).to_tiles()})
    # past 4 rows another kernel than q8_vnni: a part of a step (3 greedy, 6 other rows)
    # on the kernel its own row count picks would round as the whole step's does not
    eng.model.head.q8.vnni_limit = 4
    splits = []
    real = LMHead.split

    def split(self, x, ctx):
        out = real(self, x, ctx)
        if out is not None:
            splits.append((len(out.chosen), x.shape[0]))
        return out

    monkeypatch.setattr(LMHead, "split", split)
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=5),
             dict(temperature=1.0, top_k=4, seed=6), dict(temperature=0, logprobs=3)]
    params = [SamplingParams(**kinds[i % 4], max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(9)]
    prompts = [random_prompt(5 + 3 * i, i) for i in range(9)]

    def run(log: bool):
        eng.logits_log = [] if log else None
        reqs = [eng.add_request(p, q)[0] for p, q in zip(prompts, params)]
        drive(eng)
        return [(r.output_token_ids, r.logprobs) for r in reqs]

    fast = run(False)
    assert (3, 9) in splits  # rows 0, 4, 8 greedy beside 6 that are not
    # q8_vnni's steps (the last 4 rows: greedy row 8 beside three that are not) take every
    # row's logits in one pass over the head, no split
    assert all(rows > 4 for _, rows in splits)
    splits.clear()
    assert run(True) == fast and not splits
