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
DROP_SWITCHES or more a step and DROP_RATE or more a second, and the BASELINE steps before
(below) all came since the machine last looked quiet, it takes one thread away.

That only pays when the other process really holds the core (a busy loop: 132 ms a step
before, 31 after); a process that takes part of one (the benchmark's HTTP client on the
same two cores) slows the fewer threads more than it slowed all of them. So the drop is a
trial: after WINDOW steps with fewer threads, if a token costs no less than KEEP_GAIN of
what it cost over the BASELINE steps before, every thread comes back and no drop is tried
for a back-off (BACKOFF_S, doubled after each failed trial up to BACKOFF_MAX_S). A token's
cost is compared between steps of one kind (decode steps, one token a row, or steps with
prompt tokens, which cost far less a token), over all their time, stalls included: beside
a busy loop two threads' batch-1 steps took 17 ms, or 60-200 ms when the peer was
descheduled, and a median of per-token costs over a window that held a 64-token prompt
step said 8 ms, so one thread's steady 20 ms looked slower and the drop was undone. The
stalls come every ~10 steps, hence a baseline longer than the window, and one without
quiet steps from before the other work started: against those one thread's 20 ms looked
slow too. When the steps on trial hold too few of a kind that came before (SAME_KIND),
the trial runs on, up to TRIAL_MAX steps, then every thread comes back.

A drop need not wait for the BASELINE steps when the last WINDOW decode steps of one
batch size, switched out DROP_SWITCHES times a step on average, already cost more than
the threads left could take at the machine's quiet pace: a token of those rows cost q
quiet with every thread (the last quiet step of that many rows), so with one thread fewer
it costs at most q x all threads / (threads - 1) if the remaining threads run unhindered; a
window costing FAST_COST (1 / KEEP_GAIN) times that or more drops a thread at once, judged
as any drop. Beside a busy loop two threads' batch-1 steps took 19-27 ms with a 120-350
ms stall every 6-8 (12 quiet, 22 with one thread), and waiting for 16 of them cost ~0.6 s
of a 32-token request.

Switches alone do not say how much of a core the other work takes: a server's own
HTTP client on the same two cores (20 % of a core, waking for every streamed token)
switched the compute threads out 4-9 times a 29 ms step of 32 rows, as often as a busy
loop does, and every drop tried there (12 in 40 s) was undone, at 1-3 % of the serving
rate. So every CHECK_S seconds the governor also reads how the cores this process may run
on spent the time (/proc/stat): idle, and busy for other processes (their busy time, a
hypervisor's steal included, less this process's CPU time). A drop needs the other work
to take TAKEN_SHARE of a core beyond those already given up, over the last SPAN intervals
(a busy loop measured 0.84-1.0; one 0.1 s interval alone said 0.23 once); where the
counters cannot be read, the switches decide alone. Only an interval spent in steps
(STEPPING_SHARE of it) counts: while the engine waited for requests, the client starting
up took 0.93 of a core and 0.92 idled. With fewer threads, the cores it left free idle
once the other process is gone, and it gives all the threads back.

Steps after a wait need not find out again: a request that arrives beside a busy loop
ran its 64-token prompt step with two threads in 165-280 ms (25 quiet, ~50 with one), a
quarter of a 32-token request's time, before any decode step could show the stalls. So
before the first step after the engine waited IDLE_JUDGE_S or more, the governor reads
the cores: where other work took IDLE_TAKEN_SHARE of a core past those given up over the
wait (the engine's own CPU time is not in it; a busy loop 0.95), that step and the ones
after run with a thread fewer. Nothing judged this drop, and the HTTP client starting up
took 0.93 of a core too, so it stands only while the steps' readings still show the other
work taking TAKEN_SHARE of the cores given up (a busy loop beside one thread: ~1.0, the
client once started 0.2). A shorter wait says little: between a client's requests, its
own work fills the gap. The same judgement gives the threads back: where the other work
took less than TAKEN_SHARE of the cores given up over such a wait, they come back before
the step, drop presumed or measured. Requests whose steps never fill a reading's interval
(a prompt and a few tokens, ~0.1 s) would otherwise keep a drop that no reading can undo.

Per-row kernels (norms, GeGLU, the int8 products) give the same bits with any number of
threads; batch-invariant mode, which promises the same bits whatever happens, runs without
the governor, as do overlap scheduling (the count would change under a running forward)
and a process with SWASERVE_FIXED_THREADS=1 in its environment (the test suite, whose
bitwise comparisons run on a busy machine).

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
        average (one stall of 150 ms and 14 switches between steps of 1-3: the median of
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
    count past the cores, and a batch-1 step took 17.2 ms instead of 14.9 (~70 regions a
    step). So the thread that hands the engine to a stepping thread calls this first.
    Only the calling thread's team goes (libgomp's `omp_pause_resource_all`), and a later
    region there would build a new one."""
    lib = _gnu_openmp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
