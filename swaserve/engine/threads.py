"""ThreadGovernor: fewer compute threads while another process holds a core, all of them
again once it is gone.

A step's kernels split their work over all the threads and wait for the slowest, so when
another process takes one of the cores every parallel region waits for the thread that is
descheduled there, and a step costs many times what it costs with one thread fewer. The
governor watches two signals and drops one thread when both say a core is taken:

- Involuntary context switches (getrusage), read after each step: over the last WINDOW
  steps the median is DROP_SWITCHES or more a step and DROP_RATE or more a second (a long
  quiet step sees a few too, hence both).
- How the cores this process may run on spent their time (/proc/stat, every CHECK_S):
  other processes' busy time (steal included, this process's CPU time taken out) must be
  TAKEN_SHARE of a core past those already given up, over the last SPAN intervals spent
  at least STEPPING_SHARE in steps. Switches alone cannot tell a busy loop from a light
  neighbour that wakes often (an HTTP client streaming tokens), for which a drop only
  slows the fewer threads more. Where the counters cannot be read, switches decide alone.

A drop is a trial: after WINDOW steps with fewer threads, a token must cost less than
KEEP_GAIN of what it cost over the BASELINE steps before (steps of one kind compared,
decode or prompt, stalls included, none from before the machine last looked quiet), or
every thread comes back and no drop is tried for BACKOFF_S, doubled after each failed
trial up to BACKOFF_MAX_S. When the trial holds too few steps of a kind seen before
(SAME_KIND), it runs on for up to TRIAL_MAX steps. A drop need not wait for BASELINE steps
when the last WINDOW decode steps of one batch size, switched out DROP_SWITCHES times a
step, already cost FAST_COST times what one thread fewer would at that batch's quiet pace.
With fewer threads, once the cores given up sit FREE_SHARE idle the other process is gone
and every thread comes back.

A wait for requests is judged too, so that the first step after it need not find a busy
core out again: before the first step after a wait of IDLE_JUDGE_S or more, where other
work took IDLE_TAKEN_SHARE of a core past those given up over the wait, the step runs with
a thread fewer. That drop is presumed (nothing judged it) and stands only while the steps'
readings keep showing the other work at TAKEN_SHARE; where the other work took less than
that over the wait, the threads come back before the step, so that requests too short to
fill a reading's interval do not keep a drop no reading can undo.

Per-row kernels (norms, GeGLU, the int8 products) give the same bits with any number of
threads; batch-invariant mode, which promises the same bits whatever happens, runs without
the governor, as do overlap scheduling (the count would change under a running forward)
and a process with SWASERVE_FIXED_THREADS=1 in its environment (the test suite, whose
bitwise comparisons run on a busy machine). benchmarks/shared_cpu.py measures what it
keeps beside a busy process.

`release_openmp_workers` ends the calling thread's OpenMP team: the thread that builds an
engine and hands it to another thread to step (the server) calls it, so that the stepping
thread's team is the only one and its workers spin between regions.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("swaserve")

FIXED_THREADS_ENV = "SWASERVE_FIXED_THREADS"
WINDOW = 4  # steps whose median switch count decides
BASELINE = 16  # steps whose cost a token the drop is judged against
QUIET_SWITCHES = 1  # WINDOW steps in a row with at most this many: the machine is quiet
DROP_SWITCHES = 4  # involuntary context switches a step (and a second, below) that mean
DROP_RATE = 70.0  # a core is taken
KEEP_GAIN = 0.9  # fewer threads are kept when a token costs below this share of before
FAST_COST = 1 / KEEP_GAIN  # a window this far past what fewer threads would cost: drop now
SAME_KIND = 2  # steps of one kind on each side of a drop that can judge it
TRIAL_MAX = 4 * WINDOW  # steps on trial without enough of one kind: the threads come back
BACKOFF_S, BACKOFF_MAX_S = 1.0, 80.0  # after a drop that did not pay: no trial for this long
CHECK_S = 0.1  # how often the cores' idle and others' busy time are read
SPAN = 4  # readings' intervals they are judged over (one 10 ms tick is 5 % of 0.2 s)
TAKEN_SHARE = 0.5  # of a core past those given up, busy for other work: a drop may pay
FREE_SHARE = 0.6  # of each core given up, idle: the other process is gone
STEPPING_SHARE = 0.8  # of a reading's interval in steps, or what it read says nothing
IDLE_JUDGE_S = 0.4  # a wait at least this long is judged by what ran during it
IDLE_TAKEN_SHARE = 0.85  # of a core past those given up, busy for other work over the wait


def involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def core_seconds() -> tuple[float, float] | None:
    """(idle, busy for other processes) seconds since boot of the cores this process may
    run on: idle and iowait; and their busy time, steal included, less this process's CPU
    time. None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
        mine = {f"cpu{i}" for i in getattr(os, "sched_getaffinity", lambda _: ())(0)}
        rows = [fields for fields in lines if fields[0] in mine] or lines[:1]
        if not rows:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        idle = sum(int(f[4]) + int(f[5]) for f in rows) / tick
        total = sum(sum(int(x) for x in f[1:9]) for f in rows) / tick
    except (OSError, ValueError, IndexError):  # unreadable or a format it does not know:
        return None  # the governor goes on without counters (every step calls this)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return idle, total - idle - usage.ru_utime - usage.ru_stime


@dataclass(frozen=True)
class _Step:
    switches: int  # involuntary context switches during the step
    seconds: float
    tokens: int
    rows: int

    @property
    def decode(self) -> bool:
        """One token a row; else the step holds prompt tokens."""
        return self.tokens <= self.rows


def _token_cost(steps: list[_Step], decode: bool) -> tuple[int, float]:
    """How many of `steps` are of the kind, and their seconds a token, stalls included."""
    same = [s for s in steps if s.decode == decode]
    return len(same), sum(s.seconds for s in same) / max(sum(s.tokens for s in same), 1)


class ThreadGovernor:
    def __init__(self, threads: int, switches: Callable[[], int] = involuntary_switches,
                 cores: Callable[[], tuple[float, float] | None] = core_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.full = threads
        self.threads = threads
        self._switches, self._cores, self._clock, self._set = switches, cores, clock, set_threads
        self._recent: deque[_Step] = deque(maxlen=BASELINE)
        self._quiet = 0  # steps in a row with few switches
        self._last_switches = switches()
        self._check_at = 0.0
        self._last_cores: tuple[float, float, float] | None = None  # (clock, core_seconds)
        # the last SPAN intervals between readings spent in steps: (seconds, idle seconds,
        # others' busy seconds); no reading at all where /proc/stat cannot be read
        self._intervals: deque[tuple[float, float, float]] = deque(maxlen=SPAN)
        self._unmeasured = False
        self._stepping = 0.0  # seconds of steps since that reading
        self._before: list[_Step] | None = None  # the steps before the drop on trial
        self._trial: list[_Step] = []  # the steps since
        self._backoff = BACKOFF_S
        self._no_trial_until = 0.0
        self._quiet_cost: dict[int, float] = {}  # rows -> a decode token's seconds, quiet
        self._presumed = False  # the threads were given up before a step, after a wait
        self._last_end: float | None = None  # when the last step ended
        self.changes = 0  # times it changed the thread count

    def before_step(self) -> None:
        """Call before each step (on the thread that runs the steps): after a wait of
        IDLE_JUDGE_S or more, threads go where other work took the cores meanwhile, and
        come back where it left the cores given up free."""
        now = self._clock()
        if (self._last_end is None or now - self._last_end < IDLE_JUDGE_S
                or self._unmeasured or self._last_cores is None):
            return
        wait, self._last_end = now - self._last_end, None  # this wait is judged once
        seconds = self._cores()
        if seconds is None:
            self._unmeasured = True
            return
        # other work since the last reading (up to CHECK_S and a step before the wait
        # began) over the wait alone: a wait's busy loop is not thinned by quiet steps
        others = seconds[1] - self._last_cores[2]
        self._last_cores, self._stepping, self._check_at = (now, *seconds), 0.0, now + CHECK_S
        self._intervals.clear()
        given_up = self.full - self.threads
        if given_up and others < TAKEN_SHARE * given_up * wait:  # steps too short to read
            self._change(self.full, "the cores were free while the engine waited")
            return
        threads = self.threads
        while threads > 1 and others >= (self.full - threads + IDLE_TAKEN_SHARE) * wait:
            threads -= 1
        if threads < self.threads and now >= self._no_trial_until:
            self._change(threads, "other work took a core while the engine waited")
            self._presumed = True

    def after_step(self, seconds: float, tokens: int, rows: int) -> None:
        """Call once a step of `seconds` computing `tokens` for `rows` requests is done (on
        the thread that runs the steps)."""
        self._last_end = self._clock()
        now_switches = self._switches()
        step = _Step(now_switches - self._last_switches, seconds, tokens, rows)
        self._last_switches = now_switches
        if self._before is not None:
            self._trial.append(step)
            if not self._judge():
                return
        else:
            self._quiet = self._quiet + 1 if step.switches <= QUIET_SWITCHES else 0
            if self._quiet >= WINDOW:  # steps from before other work came judge nothing
                self._recent.clear()
            if step.decode and step.switches <= QUIET_SWITCHES and self.threads == self.full:
                self._quiet_cost[rows] = seconds / max(tokens, 1)
            self._recent.append(step)
        self._stepping += seconds
        self._read_cores()
        if (self.threads > 1 and self._clock() >= self._no_trial_until and self._others_busy()
                and ((len(self._recent) == BASELINE and self._core_taken()) or self._stalled())):
            before = list(self._recent)
            self._change(self.threads - 1, "a core is taken by other work")
            self._before = before
            return
        if self.threads < self.full and self._intervals:  # the latest reading: idle is now
            seconds, idle, others = self._intervals[-1]
            given_up = self.full - self.threads
            if idle >= FREE_SHARE * given_up * seconds:
                self._change(self.full, "the cores are free again")
            elif self._presumed and others < TAKEN_SHARE * given_up * seconds:
                self._change(self.full, "the other work was not taking a core")

    def _stalled(self) -> bool:
        """The last WINDOW decode steps of this step's rows (prompt steps between them
        aside) were switched out DROP_SWITCHES times a step and DROP_RATE a second on
        average (the mean sees one long stall between short steps, where the median of
        `_core_taken` waits for more), and a token of them cost at least FAST_COST x what
        one thread fewer would at the quiet pace (module docstring)."""
        last = self._recent[-1]
        window = [s for s in self._recent if s.decode and s.rows == last.rows][-WINDOW:]
        if not last.decode or len(window) < WINDOW:
            return False
        quiet = self._quiet_cost.get(last.rows)
        switches, seconds = sum(s.switches for s in window), sum(s.seconds for s in window)
        if (quiet is None or switches < DROP_SWITCHES * WINDOW
                or switches < DROP_RATE * seconds):
            return False
        cost = _token_cost(window, True)[1]
        return cost >= FAST_COST * quiet * self.full / (self.threads - 1)

    def _core_taken(self) -> bool:
        window = list(self._recent)[-WINDOW:]
        return (statistics.median(s.switches for s in window) >= DROP_SWITCHES
                and statistics.median(s.switches / max(s.seconds, 1e-3)
                                      for s in window) >= DROP_RATE)

    def _judge(self) -> bool:
        """Keep the drop on trial, undo it, or let it stand (True: its steps become the
        window that may take one more thread)."""
        if len(self._trial) < WINDOW:
            return False
        kinds = sorted((_token_cost(self._before, d) + (d,) for d in (True, False)),
                       key=lambda kind: kind[0], reverse=True)  # the commoner kind first
        for n_before, before, decode in kinds:
            n_trial, trial = _token_cost(self._trial, decode)
            if n_before >= SAME_KIND and n_trial >= SAME_KIND:
                if trial < KEEP_GAIN * before:
                    self._recent.extend(self._trial)
                    self._before, self._trial, self._backoff = None, [], BACKOFF_S
                    return True
                break
        else:
            if len(self._trial) < TRIAL_MAX:
                return False
        self._no_trial_until = self._clock() + self._backoff
        self._backoff = min(2 * self._backoff, BACKOFF_MAX_S)
        self._change(self.full, "fewer threads were not faster")
        return False

    def _others_busy(self) -> bool:
        """Other work took TAKEN_SHARE of a core past the cores given up (module docstring),
        or that cannot be known here."""
        if self._unmeasured:
            return True
        seconds, others = sum(i[0] for i in self._intervals), sum(i[2] for i in self._intervals)
        return seconds > 0 and others >= (self.full - self.threads + TAKEN_SHARE) * seconds

    def _read_cores(self) -> None:
        now = self._clock()
        if now < self._check_at or self._unmeasured:
            return
        self._check_at = now + CHECK_S
        seconds = self._cores()
        if seconds is None:
            self._unmeasured = True
            return
        if self._last_cores is not None and now > self._last_cores[0]:
            elapsed = now - self._last_cores[0]
            if self._stepping >= STEPPING_SHARE * elapsed:
                self._intervals.append((elapsed, *(b - a for a, b in
                                                   zip(self._last_cores[1:], seconds))))
            else:  # the engine waited: what came before says little of now
                self._intervals.clear()
        self._last_cores, self._stepping = (now, *seconds), 0.0

    def _change(self, threads: int, why: str) -> None:
        log.info("compute threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self._set(threads)
        self._recent.clear()
        self._before, self._trial = None, []
        self._last_cores = None  # measured anew with these threads
        self._intervals.clear()
        self._check_at = 0.0
        self._presumed = False
        self.changes += 1


OMP_PAUSE_HARD = 2  # omp_pause_resource_t (OpenMP 5.0)


@functools.cache
def _gnu_openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's), or None: another runtime
    (LLVM's or Intel's hard pause ends the whole runtime, not one thread's team), or none."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        paths = {str(p) for p in (Path(torch.__file__).parent / "lib").glob("libgomp*.so*")}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        return lib
    return None


def release_openmp_workers() -> bool:
    """Free the OpenMP worker threads of the calling thread's team; True if done.

    Each thread that runs a parallel region gets a team of workers of its own, kept for
    its next region. libgomp lets its workers spin between regions only while it manages
    no more threads than there are cores; past that they sleep and every region starts
    with a futex wake. A server builds the engine on the main thread (loading runs
    parallel regions there) and steps it on another: the main thread's idle team put the
    count past the cores, and each of a step's tens of regions paid a wake. So the thread that hands the engine to a stepping thread calls this first.
    Only the calling thread's team goes (libgomp's `omp_pause_resource_all`), and a later
    region there would build a new one."""
    lib = _gnu_openmp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
