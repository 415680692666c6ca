"""The LM head's int8 screen in a bf16 engine: greedy and sampling batches get the same
tokens with and without it, and a screen that raises is turned off while the step goes
on."""

from __future__ import annotations

import pytest

from swaserve.kernels import screen
from tests.conftest import drive

pytestmark = pytest.mark.skipif(not screen.available(),
                                reason="no AVX-512 VNNI and BF16 without AMX (or no compiler)")


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
