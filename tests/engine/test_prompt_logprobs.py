"""Prompt logprobs (SamplingParams.prompt_logprobs, the server's `echo`): the values of a
cold full-prompt forward, whatever the chunking, a prefix-cache hit or the batch."""

from __future__ import annotations

import pytest
import torch

from swaserve.entrypoints.llm import LLM
from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE, TINY_WINDOW, drive, hf_logprobs, random_prompt, tiny_engine

PROMPT_LEN = 4 * TINY_WINDOW + 5  # past 3 windows


def check_against(ref: torch.Tensor, prompt: list[int], plp: list, top_n: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert entry[prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(top_n)
        others = {t: v for t, v in entry.items() if t != prompt[i]}
        # the top-n are all there, with their values (the prompt token may be one of them)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)
        assert len(others) <= top_n


def llm_for(path: str, chunk: int, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_memory": "16MiB", "max_running_requests": 4,
          "page_size": 4, "chunk_size": chunk, "device": TEST_DEVICE, **kw}
    return LLM(path, **kw)


@pytest.mark.parametrize("chunk", [7, 512])
def test_prompt_logprobs_equal_transformers_cold_and_after_a_prefix_hit(tiny_hybrid, chunk):
    path, model = tiny_hybrid
    llm = llm_for(path, chunk)
    prompt = random_prompt(PROMPT_LEN, 11)
    ref = hf_logprobs(model, prompt)

    cold = llm.generate([prompt], SamplingParams(prompt_logprobs=3, max_tokens=2,
                                                 temperature=0))[0]
    check_against(ref, prompt, cold.prompt_logprobs, 3)
    # the prompt is in the prefix cache now: a plain request hits it ...
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.num_cached_tokens > 0
    # ... and a request that scores it computes it again, with the same values
    again = llm.generate([prompt], SamplingParams(prompt_logprobs=3, max_tokens=2,
                                                  temperature=0))[0]
    assert again.num_cached_tokens == 0
    check_against(ref, prompt, again.prompt_logprobs, 3)
    assert again.token_ids == cold.token_ids == plain.token_ids
    # a longer prompt that shares the cached one as its prefix is scored whole too
    longer = prompt + random_prompt(9, 12)
    out = llm.generate([longer], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    assert out.num_cached_tokens == 0
    check_against(hf_logprobs(model, longer), longer, out.prompt_logprobs, 0)
    assert llm.engine.cache.is_fully_free()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_hybrid):
    path, model = tiny_hybrid
    llm = llm_for(path, 16)
    prompt = random_prompt(20, 13)
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=1, max_tokens=0))[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    check_against(hf_logprobs(model, prompt), prompt, out.prompt_logprobs, 1)
    one = llm.generate([[5]], SamplingParams(prompt_logprobs=2, max_tokens=0))[0]
    assert one.prompt_logprobs == [None] and one.token_ids == []


@pytest.mark.parametrize("overlap", [False, True])
def test_scoring_beside_other_requests_changes_nobody(tiny_hybrid, overlap):
    """A batch of scoring and generating requests, chunked across the window and n = 2:
    every prompt's logprobs are the reference's and every completion the one it gets alone."""
    path, model = tiny_hybrid
    prompts = [random_prompt(PROMPT_LEN + i, 20 + i) for i in range(4)]
    alone = []
    for p in prompts:
        eng = llm_for(path, 7, overlap=overlap)
        alone.append(eng.generate([p], SamplingParams(temperature=0, max_tokens=6))[0].token_ids)
    llm = llm_for(path, 7, overlap=overlap)
    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=6),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=5, n=2),
              SamplingParams(temperature=0, max_tokens=6, logprobs=2)]
    outs = llm.generate(prompts, params)
    for p, sp, out, want in zip(prompts, params, outs, alone):
        for c in out.outputs:
            assert c.token_ids == want
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_against(hf_logprobs(model, p), p, out.prompt_logprobs, sp.prompt_logprobs)


def test_prompt_logprobs_survive_retraction(tiny_hybrid):
    """Requests retracted under memory pressure recompute their prompts: the logprobs are
    still a cold forward's."""
    path, model = tiny_hybrid
    row_bytes, page_bytes = 33216, 1024  # the tiny model's rings per row, one 4-token page
    eng = tiny_engine(path, kv_memory=6 * row_bytes + 40 * page_bytes, chunk_size=8,
                      max_running_requests=6)  # 40 pages: under 2 of the 6 at their end
    prompts = [random_prompt(24, 40 + i) for i in range(6)]
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                              prompt_logprobs=1))[0] for p in prompts]
    drive(eng)
    assert eng.scheduler.num_preemptions > 0  # the pool was too small for all at once
    for p, r in zip(prompts, reqs):
        check_against(hf_logprobs(model, p), p, r.prompt_logprobs, 1)


def test_a_greedy_request_scores_its_prompt_beside_the_heads_argmaxes(tmp_path):
    """A plain greedy request that asks for prompt logprobs, on a bf16 engine with an int8
    LM head: its step may take the head's argmaxes for the sampled row, and its prompt
    rows are still scored from their logits, with the values and tokens of the path that
    computes every row's logits (taken when logits are logged)."""
    from swaserve.engine.engine import Engine
    from tests.conftest import HYBRID, int8_copy, write_tiny_gemma3

    write_tiny_gemma3(tmp_path, HYBRID, seed=3)
    eng = Engine(model=str(tmp_path), dtype="bfloat16", kv_memory="16MiB", max_model_len=256,
                 prefix_cache=False)
    eng.model.use_q8({"lm_head": int8_copy(eng.model.embed)})
    prompt = random_prompt(20, 1)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)

    def run(log: bool):
        eng.logits_log = [] if log else None
        req = eng.add_request(prompt, params)[0]
        while eng.has_unfinished():
            eng.step()
        return req

    fast, logged = run(False), run(True)
    assert fast.error is None and len(fast.output_token_ids) == 3
    assert fast.output_token_ids == logged.output_token_ids
    assert fast.prompt_logprobs == logged.prompt_logprobs
    assert fast.prompt_logprobs[0] is None and all(fast.prompt_logprobs[1:])


def test_prompt_logprobs_parameter_is_checked():
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
