"""The engine on the test device (SWASERVE_TEST_DEVICE, default cpu) against transformers
past the sliding window, in both compute dtypes, and tensor parallelism at the one size a
single device runs (tp = 1). The reference is transformers' float32 model on the CPU; in
bf16 the engine must be no further from it than transformers' own bf16 model on the same
device, so the bound holds on any device without a tolerance tuned to one."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE as DEVICE
from tests.conftest import TINY_WINDOW as W
from tests.conftest import hf_greedy, hf_logits, random_prompt, tiny_engine

# float32 round-off on logits of O(1), as in test_attention_contracts
F32_TOL = 1e-4


def run_logged(eng, prompts, max_tokens):
    """Greedy runs: each request's tokens and its sampled logits rows in order."""
    eng.logits_log = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [eng.add_request(p, params)[0] for p in prompts]
    while eng.has_unfinished():
        eng.step()
    rows = [[lg for rid, _, lg in eng.logits_log if rid == r.request_id] for r in reqs]
    return [list(r.output_token_ids) for r in reqs], rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_track_transformers_past_the_window_on_the_test_device(tiny_hybrid, dtype):
    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (3, W + 1, 3 * W + 2)]
    eng = tiny_engine(path, dtype=dtype, device=DEVICE)
    tokens, rows = run_logged(eng, prompts, 3 * W)
    peer = None
    if dtype == "bfloat16":
        peer = copy.deepcopy(ref).to(device=DEVICE, dtype=torch.bfloat16)
    ours = theirs = 0.0
    for p, toks, logs in zip(prompts, tokens, rows):
        seq = p + toks
        want = hf_logits(ref, seq)[len(p) - 1:len(seq) - 1]
        got = torch.stack(logs)
        assert got.shape == want.shape
        ours = max(ours, (got - want).abs().max().item())
        if peer is not None:
            with torch.no_grad():
                hf16 = peer(torch.tensor([seq], device=DEVICE)).logits[0].float().cpu()
            theirs = max(theirs, (hf16[len(p) - 1:len(seq) - 1] - want).abs().max().item())
    if dtype == "float32":
        assert ours < F32_TOL
        assert tokens == [hf_greedy(ref, p, len(t)) for p, t in zip(prompts, tokens)]
    else:  # bf16 greedy tokens may part at near-ties, so the logits carry the check
        assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)
    assert eng.cache.is_fully_free()


def test_tensor_parallel_size_one_on_the_test_device_is_the_whole_model(tiny_hybrid):
    """One device runs tp = 1 only: no group, every weight whole (rank 0 of 1 cuts
    nothing), transformers' tokens."""
    from safetensors.torch import load_file

    from swaserve.checkpoint.shard import local_config, sharded_weights
    from swaserve.checkpoint.source import resolve_model

    path, ref = tiny_hybrid
    source = resolve_model(path)
    cfg = source.model_config()
    assert local_config(cfg, 1) is cfg
    whole = load_file(os.path.join(path, "model.safetensors"))
    shard = dict(sharded_weights(source, torch.float32, cfg, 0, 1, lambda ws: ws))
    assert shard.keys() == whole.keys()
    for name, t in whole.items():
        assert torch.equal(shard[name], t.float()), name
    eng = tiny_engine(path, tensor_parallel_size=1, device=DEVICE)
    assert eng.tp is None
    prompt = random_prompt(2 * W + 3, seed=4)
    tokens, _ = run_logged(eng, [prompt], 2 * W)
    assert tokens == [hf_greedy(ref, prompt, 2 * W)]
