"""A step's lazy MLX graph: the thread's streams, and the forward that waits for the one
`mx.eval` of the step (made by the sampler, with its own graph, or by the engine when no
row was sampled)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from swaserve.memory.kv_cache import KVLost
from swaserve.mlx import require


class StepGraph:
    def __init__(self, on_lost: Callable[[], None] | None = None):
        self.mx = require()
        self._streams = threading.local()  # MLX streams belong to the thread that made them
        self._pending: list = []
        self._done: list[Callable[[], None]] = []
        self.on_lost = on_lost  # resets the KV arrays when a forward's eval failed

    @contextlib.contextmanager
    def stream(self):
        """This thread's MLX stream (with overlap the forward and the sampler run on the
        engine's worker thread)."""
        s = self._streams
        if not hasattr(s, "main"):
            mx = self.mx
            s.main = mx.new_stream(mx.default_device())
            s.cpu = s.main if mx.default_device() == mx.cpu else mx.new_stream(mx.cpu)
        with self.mx.stream(s.main):
            yield

    def cpu_stream(self):
        """This thread's CPU stream, for float64 (Metal has none); inside `stream()`."""
        return self._streams.cpu

    def defer(self, arrays: list, done: Callable[[], None] | None = None) -> None:
        """Arrays the next `evaluate` computes too, and what to run once it has."""
        self._pending += arrays
        if done is not None:
            self._done.append(done)

    def evaluate(self, *arrays) -> None:
        """One `mx.eval` of `arrays` and everything deferred. If it raises, the deferred
        arrays alone are tried: if they evaluate, the fault was in `arrays` (the sampler's
        graph: it is raised, and the sample stage finds the row at fault); if not, the
        forward failed and its KV writes with it: KVLost."""
        pending, done = self._pending, self._done
        if not arrays and not pending:
            return
        self._pending, self._done = [], []
        with self.stream():
            try:
                self.mx.eval(*arrays, *pending)
            except Exception as e:
                if not pending:
                    raise
                try:
                    self.mx.eval(*pending)
                except Exception as lost:  # noqa: BLE001 - reported as KVLost
                    if self.on_lost is not None:
                        self.on_lost()
                    raise KVLost(f"the forward's MLX evaluation failed ({type(lost).__name__}: "
                                 f"{lost}); the KV data is reset") from lost
                for f in done:
                    f()
                raise e
        for f in done:
            f()
