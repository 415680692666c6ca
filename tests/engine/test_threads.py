"""ThreadGovernor (engine/threads.py): a thread fewer while another process holds a core
(many involuntary context switches a step and a second), kept only if a token then costs
less, all of them again once the cores it gave up idle; quiet steps, long or short, change
nothing. Driven by fake counters. And release_openmp_workers: the calling thread's OpenMP
team ends, no other thread's."""

from __future__ import annotations

import os
import time

import pytest

from swaserve.engine import threads
from swaserve.engine.threads import BACKOFF_S, BASELINE, TRIAL_MAX, WINDOW, ThreadGovernor

pytestmark = pytest.mark.cpu_only  # the governor of the CPU's threads

FREE_AFTER = 3 * threads.CHECK_S  # seconds of idle cores that free them


class Machine:
    """`taken`: cores other processes keep busy (a busy loop: 1.0), while steps run."""

    def __init__(self, taken: float = 1.0, readable: bool = True):
        self.switches, self.idle, self.others, self.now, self.set_to = 0, 0.0, 0.0, 0.0, []
        self.taken, self.readable = taken, readable

    def governor(self, threads: int) -> ThreadGovernor:
        return ThreadGovernor(threads, lambda: self.switches, self.cores,
                              lambda: self.now, self.set_to.append)

    def cores(self) -> tuple[float, float] | None:
        return (self.idle, self.others) if self.readable else None

    def step(self, gov: ThreadGovernor, seconds: float, switches: int, idle_cores: float,
             tokens: int = 1, rows: int | None = None):
        """One step; a decode step (a token a row) unless `rows` is fewer than `tokens`."""
        gov.before_step()
        self.now += seconds
        self.switches += switches
        self.idle += idle_cores * seconds
        self.others += (self.taken if switches > 1 else 0.0) * seconds
        gov.after_step(seconds, tokens, tokens if rows is None else rows)


def test_quiet_steps_keep_every_thread():
    m = Machine()
    gov = m.governor(2)
    for i in range(50):
        m.step(gov, 0.016, i % 2, 0.0)  # decode: 0-1 switches
    for _ in range(10):
        m.step(gov, 0.150, 6, 0.0)  # prefill: a few switches in a long step, ~40 a second
    assert gov.threads == 2 and m.set_to == []


def test_a_taken_core_costs_one_thread_until_it_is_free_again():
    m = Machine()
    gov = m.governor(2)
    for _ in range(BASELINE - 1):
        m.step(gov, 0.130, 14, 0.0)  # beside a busy process: ~100 switches a second
    assert gov.threads == 2  # the cost a token with every thread is not known yet
    m.step(gov, 0.130, 14, 0.0)
    assert gov.threads == 1 and m.set_to == [1]
    for _ in range(20):  # still busy, and a step is 4x faster: kept, nothing idles
        m.step(gov, 0.030, 1, 0.0)
    assert gov.threads == 1 and m.set_to == [1]
    for _ in range(int(FREE_AFTER / 0.030)):  # the other process ended: a core idles
        m.step(gov, 0.030, 0, 1.0)
    assert gov.threads == 2 and m.set_to == [1, 2]


def test_steps_far_slower_than_their_quiet_pace_drop_a_thread_after_one_window():
    """Decode steps of one batch that cost more than the threads left would take at the
    quiet pace (FAST_COST: 2 threads -> 1 at over 2.2x) drop at once, without the BASELINE
    steps; other rows' quiet pace says nothing about them, and a milder slowdown waits."""
    m = Machine()
    gov = m.governor(2)
    for _ in range(8):
        m.step(gov, 0.012, 0, 0.0)  # batch 1, quiet
    slow = 0
    while gov.threads == 2 and slow < BASELINE:
        m.step(gov, 0.120, 14, 0.0)  # beside a busy process: 10x slower
        slow += 1
    assert gov.threads == 1 and m.set_to == [1] and slow < WINDOW  # the window's 4th: quiet
    for _ in range(WINDOW):  # one thread: 0.022, kept
        m.step(gov, 0.022, 0, 0.0)
    assert gov.threads == 1 and m.set_to == [1]

    for slower in ((0.024, 5, 1), (0.240, 14, 32)):  # 2x: not past what 1 thread costs;
        m = Machine()                                 # 32 rows: never ran quiet
        gov = m.governor(2)
        for _ in range(8):
            m.step(gov, 0.012, 0, 0.0)
        seconds, switches, rows = slower
        for _ in range(BASELINE - 2):  # the baseline's first: the last quiet step
            m.step(gov, seconds, switches, 0.0, tokens=rows)
        assert gov.threads == 2 and m.set_to == [], slower


def test_more_cores_give_up_one_thread_at_a_time():
    """Other work on two of four cores: one thread goes, then a second, once other work
    still takes more than the core given up."""
    m = Machine(taken=2.0)
    gov = m.governor(4)
    for _ in range(BASELINE):
        m.step(gov, 0.100, 12, 0.0)
    assert gov.threads == 3
    for _ in range(WINDOW):  # faster: kept
        m.step(gov, 0.070, 12, 0.0)
    assert gov.threads == 3 and m.set_to == [3]
    for _ in range(BASELINE - WINDOW):  # and still contended: one more on trial
        m.step(gov, 0.070, 12, 0.0)
    assert gov.threads == 2 and m.set_to == [3, 2]
    for _ in range(WINDOW):  # faster again: kept
        m.step(gov, 0.040, 0, 0.0)
    assert gov.threads == 2
    for _ in range(int(FREE_AFTER / 0.05)):
        m.step(gov, 0.050, 0, 0.5)  # half a core idle of the two given up: not free yet
    assert gov.threads == 2
    for _ in range(int(FREE_AFTER / 0.05)):
        m.step(gov, 0.050, 0, 2.0)
    assert gov.threads == 4


def test_work_that_takes_little_of_a_core_drops_no_thread_however_often_it_switches():
    """An HTTP client on the same two cores (a fifth of one) wakes for every streamed token
    and switches the compute threads out as often as a busy loop does."""
    m = Machine(taken=0.2)
    gov = m.governor(2)
    for _ in range(8):
        m.step(gov, 0.012, 0, 0.0)  # batch 1, quiet
    m.now += 1.0  # no step: the engine waits while the client starts up on a core
    m.others, m.idle = m.others + 0.93, m.idle + 0.92
    m.step(gov, 0.130, 14, 0.0)  # the wait looked like a busy loop: one thread, presumed
    assert gov.threads == 1 and m.set_to == [1]
    for _ in range(int(FREE_AFTER / 0.130)):  # the steps' readings show 0.2 of a core
        m.step(gov, 0.130, 14, 0.0)
    assert gov.threads == 2 and m.set_to == [1, 2]
    for _ in range(4 * BASELINE):
        m.step(gov, 0.130, 14, 0.0)  # slow enough for the fast drop too
    assert gov.threads == 2 and m.set_to == [1, 2]
    m.taken = 0.8  # then a busy loop: the same switches, now a core is taken
    for _ in range(BASELINE):
        m.step(gov, 0.130, 14, 0.0)
        if gov.threads == 1:
            break
    assert gov.threads == 1 and m.set_to == [1, 2, 1]


def test_a_core_taken_while_the_engine_waited_costs_a_thread_from_the_first_step_on():
    """A request arrives beside a busy loop that ran through the wait: its prompt step
    and the steps after run with one thread, until the loop ends and a core idles. A
    short wait, however busy, or one where other work took less than a core, changes
    nothing."""
    for wait, taken, drops in ((0.2, 1.0, False), (2.0, 0.6, False), (0.5, 0.95, True)):
        m = Machine()
        gov = m.governor(2)
        for _ in range(8):
            m.step(gov, 0.012, 0, 0.0)  # batch 1, quiet
        m.now += wait
        m.others += taken * wait
        m.step(gov, 0.050, 3, 0.0, tokens=64, rows=1)  # the prompt step
        assert (gov.threads == 1) == drops, (wait, taken)
    for _ in range(int(FREE_AFTER / 0.020)):  # drop stands: the loop still takes a core
        m.step(gov, 0.020, 2, 0.0)
    assert gov.threads == 1 and m.set_to == [1]
    for _ in range(int(FREE_AFTER / 0.020)):  # the loop ended: the core idles
        m.step(gov, 0.020, 0, 1.0)
    assert gov.threads == 2 and m.set_to == [1, 2]


def test_a_wait_with_the_cores_free_gives_the_threads_back_however_short_the_steps():
    """Short requests apart in time (steps never fill a reading's interval): a drop,
    presumed or measured, comes back before the first step after a wait in which the
    other work left the given-up core free, and stands while it kept taking it."""
    for measured in (False, True):
        m = Machine()
        gov = m.governor(2)
        for _ in range(8):
            m.step(gov, 0.012, 0, 0.0)
        if measured:  # beside a busy loop from the first step on
            for _ in range(BASELINE):
                m.step(gov, 0.130, 14, 0.0)
                if gov.threads == 1:
                    break
        else:  # the wait looked like a busy loop
            m.now += 0.5
            m.others += 0.95 * 0.5
        m.step(gov, 0.030, 3, 0.0)
        assert gov.threads == 1, measured
        for _ in range(3):  # the loop goes on: waits it fills leave the drop standing
            m.now += 0.5
            m.others += 0.9 * 0.5
            for _ in range(3):
                m.step(gov, 0.015, 2, 0.0)
        assert gov.threads == 1, measured
        m.now += 0.5  # the loop has ended: the next request finds the cores free
        m.others += 0.05
        m.step(gov, 0.015, 0, 1.0)
        assert gov.threads == 2 and m.set_to == [1, 2], measured


def test_switches_decide_alone_where_the_cores_time_cannot_be_read():
    m = Machine(taken=0.0, readable=False)
    gov = m.governor(2)
    for _ in range(BASELINE):
        m.step(gov, 0.130, 14, 0.0)
    assert gov.threads == 1


def test_a_drop_that_does_not_pay_is_undone_and_not_tried_again_for_a_while():
    """Another process takes part of a core (here 0.6 of one: past TAKEN_SHARE): the
    switches and the busy time say "taken", but one thread computes a token slower than
    two did."""
    m = Machine(taken=0.6)
    gov = m.governor(2)
    for _ in range(BASELINE):
        m.step(gov, 0.050, 8, 0.0, tokens=32)
    assert gov.threads == 1
    for _ in range(WINDOW):
        m.step(gov, 0.060, 1, 0.0, tokens=32)
    assert gov.threads == 2 and m.set_to == [1, 2]
    for _ in range(int(BACKOFF_S / 0.050) - 2):  # contended, but backing off
        m.step(gov, 0.050, 8, 0.0, tokens=32)
    assert gov.threads == 2
    for _ in range(3 * BASELINE):  # the back-off is over: tried again, undone again
        m.step(gov, 0.050 if gov.threads == 2 else 0.060, 8, 0.0, tokens=32)
    assert m.set_to[:4] == [1, 2, 1, 2]


def test_prompt_steps_do_not_set_the_cost_a_decode_step_is_judged_by():
    """Seen live beside a busy loop: two 64-token prompt steps, then two threads' decode
    steps of 17 ms with a 140 ms stall now and then, then one thread's steady 20 ms. Against
    the prompt steps' cost a token (or all steps') they look slower; against the decode
    steps', stalls included, they are faster."""
    m = Machine()
    gov = m.governor(2)
    for _ in range(WINDOW):  # quiet decode first: not part of what the drop is judged by
        m.step(gov, 0.012, 0, 0.0)
    steps = [(0.375, 64, 39), (0.088, 64, 14)] + [(0.017, 1, 3)] * 10 + [
        (0.140, 1, 15), (0.017, 1, 3), (0.140, 1, 15), (0.017, 1, 3)]
    for seconds, tokens, switches in steps:  # two threads' steps, until one is dropped
        m.step(gov, seconds, switches, 0.0, tokens=tokens, rows=1)
        if gov.threads == 1:
            break
    assert gov.threads == 1
    for _ in range(2 * WINDOW):
        m.step(gov, 0.020, 0, 0.0)
    assert gov.threads == 1 and m.set_to == [1]


def test_a_trial_without_steps_like_those_before_it_gives_the_threads_back():
    m = Machine()
    gov = m.governor(2)
    for _ in range(BASELINE):
        m.step(gov, 0.130, 14, 0.0)  # decode
    assert gov.threads == 1
    for _ in range(TRIAL_MAX - 1):  # only prompt steps: nothing to judge the drop by yet
        m.step(gov, 0.050, 0, 0.0, tokens=64, rows=1)
    assert gov.threads == 1
    m.step(gov, 0.050, 0, 0.0, tokens=64, rows=1)
    assert gov.threads == 2 and m.set_to == [1, 2]


def test_engine_runs_a_governor_on_the_cpu_unless_asked_not_to(tiny_hybrid, monkeypatch):
    from tests.conftest import tiny_engine

    monkeypatch.delenv("SWASERVE_FIXED_THREADS")
    assert tiny_engine(tiny_hybrid[0], num_threads=2).governor is not None
    assert tiny_engine(tiny_hybrid[0], num_threads=2, adaptive_threads=False).governor is None
    assert tiny_engine(tiny_hybrid[0], num_threads=2, batch_invariant=True).governor is None
    assert tiny_engine(tiny_hybrid[0], num_threads=2, overlap=True).governor is None
    monkeypatch.setenv("SWASERVE_FIXED_THREADS", "1")
    assert tiny_engine(tiny_hybrid[0], num_threads=2).governor is None


def test_release_openmp_workers_frees_the_calling_threads_team_only():
    """A thread's parallel region leaves a team of workers behind (OS threads of the
    process); releasing it ends them, and another thread's team is left running."""
    import os
    import subprocess
    import sys
    import textwrap

    from swaserve.engine.threads import _gnu_openmp

    if _gnu_openmp() is None:
        pytest.skip("this torch does not run on GNU OpenMP")
    code = textwrap.dedent("""
        import os, threading, time, torch
        from swaserve.engine.threads import release_openmp_workers
        torch.set_num_threads(2)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        base = tasks()
        x = torch.ones(4_000_000)  # parallel regions on the main thread: its team of 1 worker
        float(x.sum())
        with_team = tasks()
        go, done = threading.Event(), threading.Event()
        def other():  # a thread whose team must outlive the main thread's release
            float(x.sum())
            go.set()
            done.wait()
            float(x.sum())
        t = threading.Thread(target=other)
        t.start()
        go.wait()
        both = tasks()
        released = release_openmp_workers()
        for _ in range(500):  # the worker exits once released
            if tasks() < both:
                break
            time.sleep(0.01)
        after = tasks()
        done.set()
        t.join()
        print(base, with_team, both, released, after)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    base, with_team, both, released, after = out.stdout.split()
    base, with_team, both, after = int(base), int(with_team), int(both), int(after)
    assert released == "True"
    assert with_team == base + 1  # the main thread's worker
    assert both == with_team + 2  # the other thread and its own worker
    assert after == both - 1  # the main thread's worker is gone, the other's still there


def test_async_engine_releases_the_workers_of_the_thread_that_built_it(tiny_hybrid,
                                                                        monkeypatch):
    import threading

    from swaserve.server import async_engine
    from tests.conftest import tiny_engine

    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_workers",
                        lambda: calls.append(threading.current_thread()) or True)
    aeng = async_engine.AsyncEngine(tiny_engine(tiny_hybrid[0]))
    try:
        assert calls == [threading.current_thread()]
    finally:
        aeng.shutdown()


def test_compute_threads_default_to_the_cores_this_process_may_run_on(monkeypatch):
    """A container's cpuset on a bigger host: its cores, not the host's count."""
    from swaserve.config import EngineConfig
    from swaserve.distributed.workers import threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads_per_rank(EngineConfig()) == 3
    assert threads_per_rank(EngineConfig(tensor_parallel_size=3)) == 1
    assert threads_per_rank(EngineConfig(num_threads=8)) == 8


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_core_seconds_count_another_process_as_others_and_this_one_not():
    import resource
    import subprocess
    import sys

    from swaserve.engine.threads import core_seconds

    def children() -> float:  # CPU seconds of this process's ended children so far
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    children0 = children()
    idle0, others0 = core_seconds()
    spin = "import time\nt = time.time()\nwhile time.time() - t < 0.4: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    t = time.process_time()
    while time.process_time() - t < 0.6:  # this process's own work is not "others"
        pass
    idle1, others1 = core_seconds()
    child = children() - children0
    assert idle1 >= idle0
    # /proc/stat samples ticks: a share of the child's time, and far less than its and ours
    assert 0.7 * child <= others1 - others0 <= child + 0.3


def test_core_counters_in_a_format_it_does_not_know_read_as_none(monkeypatch):
    """/proc/stat cut short or with a field that is not a number: no counters (the governor
    then goes on from the switches), not an exception out of the engine's step."""
    import io

    assert threads.core_seconds() is None or len(threads.core_seconds()) == 2
    for text in ("cpu  1 2 3\n", "cpu  1 2 3 x 5 6 7 8\n"):
        monkeypatch.setattr(threads, "open", lambda *a, text=text, **k: io.StringIO(text),
                            raising=False)
        assert threads.core_seconds() is None
