"""The step profiler (swaserve/profile.py): off by default; on, every part of a step is
timed, exclusively, and the parts add up to the steps' wall time."""

from __future__ import annotations

import time

import pytest

from swaserve import profile
from swaserve.sampling.params import SamplingParams
from tests.conftest import random_prompt, tiny_engine, use_int8_copies


def test_profiler_is_off_by_default(tiny_hybrid):
    eng = tiny_engine(tiny_hybrid[0])
    assert eng.profile is None and profile.active() is None


def test_profiled_steps_split_into_parts_that_add_up(tiny_hybrid):
    eng = tiny_engine(tiny_hybrid[0], profile=True)
    try:
        assert profile.active() is eng.profile
        for i in range(3):
            eng.add_request(random_prompt(30, i), SamplingParams(temperature=0, max_tokens=8))
        wall = 0.0
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            wall += time.perf_counter() - t0
        parts = eng.profile.report()
        for name in ("projections", "attention", "norms + activations", "lm head", "sampler",
                     "schedule", "prepare inputs", "postprocess", "host (rest of the step)"):
            assert parts[name][0] > 0 and parts[name][1] > 0, name
        total = sum(s for s, _ in parts.values())
        assert abs(total - wall) < 0.05 * wall + 1e-3  # exclusive times: nothing counted twice
    finally:
        profile.stop()


@pytest.mark.cpu_only
def test_the_fused_decode_call_reports_its_kernels_parts(tiny_hybrid):
    """A fused decode step (kernels/decode.c) is one C call: its own timers split it into
    the projections, attention and norms of the layer-by-layer path, what is left (the
    cache writes) stays its part, and the parts still add up to the wall time."""
    from swaserve.kernels import q8
    if not (q8.vnni_available() or q8.amx_available()):
        pytest.skip("no int8 tile kernel here: no fused decode step")
    eng = tiny_engine(tiny_hybrid[0], dtype="bfloat16", prefix_cache=False, profile=True)
    use_int8_copies(eng)
    try:
        eng.add_request(random_prompt(6, 0), SamplingParams(temperature=0, max_tokens=12,
                                                            ignore_eos=True))
        eng.step()  # the prompt, layer by layer
        eng.profile.reset()
        wall = 0.0
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            wall += time.perf_counter() - t0
        assert eng.model.fused_decode_steps >= 10
        parts = eng.profile.report()
        fused = parts["fused decode layers"]
        for name in ("projections", "attention", "norms + activations"):
            seconds, calls = parts[name]
            assert seconds > 0 and calls >= fused[1], name  # credited once per fused call
        assert fused[0] >= 0  # the credited seconds were inside the call
        total = sum(s for s, _ in parts.values())
        assert abs(total - wall) < 0.05 * wall + 1e-3
    finally:
        profile.stop()
