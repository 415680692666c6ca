"""Step profiler: where a step's time goes, by part (LM head, projections, attention,
norms and activations, the fused decode call, sampling, scheduling and host work).

Off by default, and then a timed function costs one extra Python call. `EngineConfig(
profile=True)` or `SWASERVE_PROFILE=1` turns it on; `Engine.profile.report()` gives each
part's exclusive seconds (a part's own time, its timed callees' taken out) and calls, and
`benchmarks/roofline.py` prints them per step. On a GPU each part synchronizes the device
at its ends, so the figures are device time (and the run is slower).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict

import torch

ENV = "SWASERVE_PROFILE"


class Profiler:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)  # exclusive
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self._sync = torch.cuda.is_available() and torch.cuda.is_initialized()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, name: str) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self._stack().append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        if self._sync:
            torch.cuda.synchronize()
        name, start, inner = self._stack().pop()
        spent = time.perf_counter() - start
        self.seconds[name] += spent - inner
        self.calls[name] += 1
        stack = self._stack()
        if stack:
            stack[-1][2] += spent

    def credit(self, name: str, seconds: float) -> None:
        """`seconds` measured inside the part now running (a C call's own timers) count
        to part `name` instead."""
        self.seconds[name] += seconds
        self.calls[name] += 1
        stack = self._stack()
        if stack:
            stack[-1][2] += seconds

    def report(self) -> dict[str, tuple[float, int]]:
        """part -> (exclusive seconds, calls), largest first."""
        return {k: (self.seconds[k], self.calls[k])
                for k in sorted(self.seconds, key=lambda k: -self.seconds[k])}


_active: Profiler | None = None


def start(profiler: Profiler | None = None) -> Profiler:
    """Profile from now on (into `profiler`, or a new one); returns it."""
    global _active
    _active = profiler or Profiler()
    return _active


def stop() -> None:
    global _active
    _active = None


def active() -> Profiler | None:
    return _active


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def timed(name: str):
    """Decorator: the function's time counts to part `name` while profiling is on."""
    def wrap(fn):
        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            prof = _active
            if prof is None:
                return fn(*args, **kwargs)
            prof.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                prof.exit()
        return timed_fn
    return wrap
