"""The accuracy gate of the layers' activations on the bundled model (slow): teacher forced
over the real-model tests' prompts, the default engine's next-token distributions stay as
close to the float32 engine's as measured (mean KL, greedy agreement), and int8
activations (q8_dpbusd, opt-in) stay further from them than that, which is why they are
not the default (benchmarks/activation_accuracy.py measures the variants)."""

from __future__ import annotations

import pytest

from tests.helpers.accuracy import Distance, gate_prompts, prompt_logprobs

pytestmark = pytest.mark.slow


def test_default_activations_pass_the_gate_and_int8_ones_do_not():
    from swaserve.config import EngineConfig
    from swaserve.engine.engine import Engine
    from swaserve.kernels import q8

    options = dict(prefix_cache=False, max_running_requests=1, max_model_len=2048,
                   kv_memory="256MiB")
    ref = Engine(dtype="float32", **options)
    default = Engine(**options)
    assert EngineConfig().int8_activations is False
    prompts = gate_prompts(ref.tokenize, short=12, long=0)
    ref_lp = [prompt_logprobs(ref, ids) for ids in prompts]
    del ref
    d_default = Distance()
    for ids, lp in zip(prompts, ref_lp):
        d_default.add(lp, prompt_logprobs(default, ids))
    kl, same, n = d_default.summary()
    assert n >= 400
    # measured on Zen 4 (q8_dpbf16 prompt steps): 32 prompts 0.00088 and 98.4 %
    assert kl < 0.002 and same >= 0.96
    del default
    if q8.amx_available() or q8.tile_kernel(64, int8=True) != "dpbusd":
        return  # int8 activations take no product here
    int8 = Engine(int8_activations=True, **options)
    d_int8 = Distance()
    for ids, lp in zip(prompts, ref_lp):
        d_int8.add(lp, prompt_logprobs(int8, ids))
    kl8, _, _ = d_int8.summary()
    # 32 prompts on Zen 4: 0.0074 and 94.0 %; when int8 reaches the default's figures it
    # can be the default where VNNI is present
    assert kl8 > 2 * kl
