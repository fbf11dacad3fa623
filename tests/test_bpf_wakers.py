"""The waker the host tracer records for a traced thread's wakeups (the real bcc programs; no GPU).

A wakeup that runs in an interrupt (a sleep's hrtimer, a packet's softirq, a disk completion) has no
waking task: the tracer records waker 0 there, not the task the interrupt happened to interrupt. A
task's wakeup is recorded in the waker's own context, not on the wakee's CPU, where the kernel often
finishes it (a wakeup onto an idle CPU is queued there: its current task is the idle task, 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ingero.agent.trace.probes import BpfProbes, ProbeOptions
from ingero.store.catalog import op_id

pytestmark = pytest.mark.bpf

BUSY_CPU, OTHER_CPU = 0, 1
SLEEPS, WRITES = 300, 200
# Each child says when its interpreter has started: two Pythons starting together on one CPU really wake
# each other (a page of libpython locked by the one faulting it in), and those wakeups are not the test's.
READY = "print('ready', flush=True)\n"
SLEEPER = f"import sys, time\n{READY}sys.stdin.readline()\nfor _ in range({SLEEPS}): time.sleep(0.002)"
READER = f"import os\n{READY}while os.read(0, 1): pass"
HOG = f"{READY}while True: pass"


def started(child: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """Wait until ``child`` printed that its interpreter is up."""
    assert child.stdout is not None
    assert child.stdout.readline().strip() in ("ready", b"ready")


@pytest.fixture(scope="module")
def probes() -> Iterator[BpfProbes]:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPUs")
    with BpfProbes(ProbeOptions(pid_filter=True, io=False)) as p:
        yield p


def wakers(probes: BpfProbes, pid: int) -> np.ndarray:
    """The waker tgids of every wakeup of ``pid`` recorded since the last read."""
    ev = probes.read_events()
    source, op = op_id("sched_wakeup")
    return np.asarray(ev["arg0"][(ev["source"] == source) & (ev["op"] == op) & (ev["pid"] == pid)])


def test_a_timer_wakeup_on_a_busy_core_has_no_waker(probes: BpfProbes) -> None:
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(hog.pid, {BUSY_CPU})
        started(hog)
        sleeper = subprocess.Popen(
            [sys.executable, "-c", SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert sleeper.stdin is not None
        os.sched_setaffinity(sleeper.pid, {BUSY_CPU})
        started(sleeper)
        probes.add_targets([sleeper.pid])
        wakers(probes, sleeper.pid)  # forget what came before
        sleeper.stdin.write("go\n")
        sleeper.stdin.flush()
        assert sleeper.wait(timeout=120) == 0
    finally:
        hog.kill()
        hog.wait()
    got = wakers(probes, sleeper.pid)
    timer = int((got == 0).sum())
    assert hog.pid not in got, f"the hog the timer interrupted was named the waker {int((got == hog.pid).sum())} times"
    assert set(got.tolist()) <= {0, os.getpid()}, f"wakers {sorted(set(got.tolist()))}"
    assert timer >= 0.8 * SLEEPS, f"{timer} timer wakeups of {SLEEPS} sleeps"


def test_a_task_waking_a_thread_on_another_core_is_its_waker(probes: BpfProbes) -> None:
    mine = os.sched_getaffinity(0)
    reader = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert reader.stdin is not None
    try:
        os.sched_setaffinity(reader.pid, {OTHER_CPU})
        os.sched_setaffinity(0, {BUSY_CPU})
        started(reader)
        probes.add_targets([reader.pid])
        time.sleep(0.1)  # the reader is blocked on its pipe, known to the tracer as off the CPU
        wakers(probes, reader.pid)
        for _ in range(WRITES):
            reader.stdin.write(b"x")
            reader.stdin.flush()
            time.sleep(0.002)  # it reads and blocks again
    finally:
        os.sched_setaffinity(0, mine)
        reader.stdin.close()
        assert reader.wait(timeout=60) == 0
    got = wakers(probes, reader.pid)
    assert got.size >= WRITES // 4, f"{got.size} wakeups of {WRITES} writes"  # a loaded reader misses some
    assert (got == os.getpid()).all(), f"wakers {sorted(set(got.tolist()))} (the writer is {os.getpid()})"
