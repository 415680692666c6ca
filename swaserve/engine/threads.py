"""ThreadGovernor: fewer compute threads while another process holds a core, all of them
again once it is gone.

A step's kernels split their work over all the threads and wait for the slowest; when
another process takes one of the cores, the thread on it is descheduled for whole time
slices and every parallel region waits for it (measured here, batch-1 decode beside one
busy process: 132 ms a step with 2 threads against 31 with 1, and 17 quiet). Being
preempted shows as involuntary context switches: quiet, a decode step sees 0-1; beside a
busy process, 14-30, about 100 a second. A long quiet step sees a few too (a 150 ms
prefill step 3-7, some 40 a second), so both count: after each step the governor reads the
process's count (getrusage), and when over the last WINDOW steps the median is
DROP_SWITCHES or more a step and DROP_RATE or more a second, it takes one thread away. While it runs with fewer threads it reads the machine's idle time
(/proc/stat) every CHECK_S seconds: the cores it left free idle once the other process
is gone, and it gives all the threads back.

Per-row kernels (norms, GeGLU, the int8 products) give the same bits with any number of
threads; batch-invariant mode, which promises the same bits whatever happens, runs without
the governor, and so does a process with SWASERVE_FIXED_THREADS=1 in its environment (the
test suite, whose bitwise comparisons run on a busy machine).
"""

from __future__ import annotations

import logging
import os
import resource
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger("swaserve")

FIXED_THREADS_ENV = "SWASERVE_FIXED_THREADS"
WINDOW = 4  # steps whose median switch count decides
DROP_SWITCHES = 4  # involuntary context switches a step (and a second, below) that mean
DROP_RATE = 70.0  # a core is taken
CHECK_S = 0.25  # with fewer threads: how often the idle time is read
FREE_SHARE = 0.6  # of each core given up, idle: the other process is gone


def involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def idle_seconds() -> float | None:
    """All cores' idle (and iowait) seconds since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    def __init__(self, threads: int, switches: Callable[[], int] = involuntary_switches,
                 idle: Callable[[], float | None] = idle_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.full = threads
        self.threads = threads
        self._switches, self._idle, self._clock, self._set = switches, idle, clock, set_threads
        self._recent: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (switches, rate)
        self._last_switches = switches()
        self._check_at = 0.0
        self._last_idle: tuple[float, float] | None = None  # (clock, idle seconds)
        self.changes = 0  # times it changed the thread count

    def after_step(self, seconds: float) -> None:
        """Call once a step of `seconds` is done (on the thread that runs the steps)."""
        now_switches = self._switches()
        n = now_switches - self._last_switches
        self._recent.append((n, n / max(seconds, 1e-3)))
        self._last_switches = now_switches
        if (self.threads > 1 and len(self._recent) == WINDOW
                and statistics.median(c for c, _ in self._recent) >= DROP_SWITCHES
                and statistics.median(r for _, r in self._recent) >= DROP_RATE):
            self._change(self.threads - 1, "a core is taken by other work")
            return
        if self.threads < self.full:
            self._check_free()

    def _check_free(self) -> None:
        now = self._clock()
        if now < self._check_at:
            return
        self._check_at = now + CHECK_S
        idle = self._idle()
        if idle is None:
            return
        if self._last_idle is not None:
            elapsed = now - self._last_idle[0]
            idle_cores = (idle - self._last_idle[1]) / elapsed if elapsed > 0 else 0.0
            if idle_cores >= FREE_SHARE * (self.full - self.threads):
                self._change(self.full, "the cores are free again")
                return
        self._last_idle = (now, idle)

    def _change(self, threads: int, why: str) -> None:
        log.info("compute threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self._set(threads)
        self._recent.clear()
        self._last_idle = None
        self._check_at = 0.0
        self.changes += 1
