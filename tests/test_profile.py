"""The step profiler (swaserve/profile.py): off by default; on, every part of a step is
timed, exclusively, and the parts add up to the steps' wall time."""

from __future__ import annotations

import time

from conftest import random_prompt, tiny_engine

from swaserve import profile
from swaserve.sampling.params import SamplingParams


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
