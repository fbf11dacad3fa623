"""Synthetic recordings that look like real ones, for explain's must-name / must-not-name checks.

The six ``ingero demo`` scenarios are clean: one disturbance, one kernel, fixed copy sizes. Real traces
are not. These builders add what real recordings of healthy and unhealthy jobs contain, written the
way ingero's tracer writes it:

* the GPU thread sleeps voluntarily all the time — inside ``cudaStreamSynchronize`` (blocking sync),
  on the DataLoader queue (woken by a worker), in ``usleep``/``futex`` between steps;
* forked DataLoader workers (``process_fork`` rows), kernel launches keyed by kernel function
  (``arg0``) with each kernel's first launch slow (lazy module loading), copies of mixed sizes;
* selective storage: most launches are only counted in ``event_aggregates``;
* host-wide noise that is nobody's fault here: softirq TCP retransmits (pid 0), a kworker's writeback,
  the ingero agent's own database writes, short ordinary preemptions, an idle pause (evaluation).

Each builder returns a :class:`SyntheticNode` for one node. What explain must and must not say about
each lives with the tests (``tests/scenarios/expectations.py``, checked by ``tests/test_explain_scenarios.py``).
"""

from __future__ import annotations

from ingero.demo.synth import (
    ALL_REDUCE,
    LAUNCH,
    MALLOC,
    MEMCPY,
    PROCESS_FORK,
    SCHED_WAKEUP,
    SESSION,
    STREAM_SYNC,
    TCP_RETRANSMIT,
    SyntheticNode,
)
from ingero.timeutil import NS_PER_MS, NS_PER_US

KERNELS = tuple(0x7F3A_2000_0000 + 0x1C0 * k for k in range(6))  # kernel function pointers
AGENT, KWORKER = 999, 281
PINNED_BPS = 11e9


def _rec(node: str, base_ns: int, seed: int, pid: int, cmd: str) -> SyntheticNode:
    """A node whose trainer process ``pid`` (command line ``cmd``) runs from t=0."""
    rec = SyntheticNode(node, base_ns, seed)
    rec.session = dict(SESSION)
    rec.process(pid, cmd, 0.0, exec_event=False)
    return rec


def _noise(rec: SyntheticNode, pid: int, seconds: float) -> None:
    """What a real node shows that is not the job's problem."""
    rec.process(AGENT, "ingero trace --record", 0.0, exec_event=False)
    rec.process(KWORKER, "kworker/u16:6+flush-259:0", 0.0, exec_event=False)
    for t in sorted(rec.rng.uniform(0.0, seconds, int(8 * seconds))):  # the agent's own database writes
        rec.block_io(float(t), AGENT, True, rec.jitter(1.2 * NS_PER_MS, 0.4), 64)
    for t in sorted(rec.rng.uniform(0.0, seconds, int(2 * seconds))):  # writeback of other files
        rec.block_io(float(t), KWORKER, True, rec.jitter(3 * NS_PER_MS, 0.4), 256)
    burst = seconds * 0.3
    for t in sorted(rec.rng.uniform(burst, burst + 3.0, 150)):  # softirq retransmits: no owner
        rec.ev(float(t), 0, *TCP_RETRANSMIT, 0)
    rec.snapshots_every(0.0, seconds, lambda s: 62.0)


def _launches(rec: SyntheticNode, t: float, pid: int, seen: set[int], n: int = 8) -> float:
    """``n`` kernel launches; a kernel's first launch pays lazy module loading. Most launches are only
    counted (selective storage keeps a sample)."""
    for k in range(n):
        fn = KERNELS[(k * 5 + int(t * 7)) % len(KERNELS)]
        first = fn not in seen
        seen.add(fn)
        dur = float(rec.rng.uniform(3, 15)) * NS_PER_MS if first else rec.jitter(7 * NS_PER_US, 0.15)
        rec.ev(t, pid, *LAUNCH, dur, arg0=fn, store=first or rec.rng.random() < 0.3)
        t += dur / 1e9 + 20e-6
    return t


def _copy(rec: SyntheticNode, t: float, pid: int) -> float:
    size = int(rec.rng.choice([256 << 10, 4 << 20, 16 << 20]))
    dur = size / PINNED_BPS * 1e9 * rec.jitter(1.0, 0.05) + 8 * NS_PER_US
    rec.ev(t, pid, *MEMCPY, dur, arg0=size, arg1=1)
    return t + dur / 1e9 + 10e-6


def _sync(rec: SyntheticNode, t: float, pid: int, gpu_ms: float, waker: int = 0) -> float:
    """cudaStreamSynchronize with blocking sync: the thread sleeps inside it until the GPU is done."""
    dur = rec.jitter(gpu_ms * NS_PER_MS, 0.05)
    rec.ev(t, pid, *STREAM_SYNC, dur)
    rec.sleep(t + 100e-6, pid, dur - 150 * NS_PER_US, waker=waker)
    return t + dur / 1e9


def _fork_workers(rec: SyntheticNode, pid: int, n: int, t: float) -> list[int]:
    kids = [pid + 1 + i for i in range(n)]
    for k in kids:
        rec.process(k, "pt_data_worker", t, exec_event=False)
        rec.ev(t, pid, *PROCESS_FORK, 0, arg1=k)
    return kids


def healthy(base_ns: int, seed: int) -> SyntheticNode:
    """A healthy trainer: fast workers, blocking syncs, usleep between steps, an eval pause, noise."""
    pid, seconds = 5000, 40.0
    rec = _rec("healthy-node", base_ns, seed, pid, "python3 train.py")
    kids = _fork_workers(rec, pid, 3, 0.1)
    seen: set[int] = set()
    t, i = 0.2, 0
    while t < seconds:
        if 20.0 <= t < 23.0:  # evaluation on the CPU side / a pause: the thread sleeps, nothing is wrong
            rec.sleep(t, pid, 3e9 - (t - 20.0) * 1e9, waker=0)
            t = 23.0
            continue
        rec.sleep(t, pid, rec.jitter(0.3 * NS_PER_MS), waker=kids[i % len(kids)])  # next batch: ready
        t += 0.4e-3
        t = _copy(rec, t, pid)
        t = _launches(rec, t, pid, seen)
        if i % 50 == 0:
            rec.ev(t, pid, *MALLOC, rec.jitter(90 * NS_PER_US), arg0=64 << 20)
            t += 0.2e-3
        t = _sync(rec, t, pid, 9.0)
        if rec.rng.random() < 0.02:  # an ordinary preemption in host code
            rec.sched(t + 1e-4, pid, float(rec.rng.uniform(0.1, 0.5)) * NS_PER_MS, by=KWORKER)
            t += 1e-3
        rec.sleep(t, pid, rec.jitter(2 * NS_PER_MS, 0.1))  # usleep / futex between steps
        t += 2.1e-3
        i += 1
    _noise(rec, pid, seconds)
    return rec


def dataloader_starved(base_ns: int, seed: int) -> SyntheticNode:
    """The workers are slow to produce batches: each step the trainer sleeps ~35 ms until one wakes it."""
    pid, seconds = 5100, 30.0
    rec = _rec("starved-node", base_ns, seed, pid, "python3 train.py --num-workers 4")
    kids = _fork_workers(rec, pid, 4, 0.1)
    seen: set[int] = set()
    t, i = 0.3, 0
    while t < seconds:
        wait = rec.jitter(35 * NS_PER_MS, 0.2)
        rec.sleep(t, pid, wait, waker=kids[i % len(kids)])
        t += wait / 1e9 + 50e-6
        t = _copy(rec, t, pid)
        t = _launches(rec, t, pid, seen)
        t = _sync(rec, t, pid, 10.0)
        i += 1
    for k in kids:  # the workers decode and augment: busy, preempting each other now and then
        rec.background(0.2, seconds, k, 20, 0.3 * NS_PER_MS, by=kids[0] if k != kids[0] else kids[1])
    _noise(rec, pid, seconds)
    return rec


def collective_wait(base_ns: int, seed: int) -> SyntheticNode:
    """A fast rank of a data-parallel job: every step it waits inside ncclAllReduce for a slower peer,
    asleep (futex/poll) in the collective and in the sync that follows — waiting, not contention."""
    pid, seconds = 5200, 30.0
    rec = _rec("rank-node", base_ns, seed, pid, "python3 train.py --rank 1")
    seen: set[int] = set()
    t = 0.3
    while t < seconds:
        t = _launches(rec, t, pid, seen, n=12)
        t = _sync(rec, t, pid, 20.0)
        wait = float(rec.rng.choice([2.0, 4.0, 30.0, 45.0], p=[0.5, 0.2, 0.2, 0.1])) * NS_PER_MS
        dur = wait + rec.jitter(3 * NS_PER_MS, 0.1)
        rec.ev(t, pid, *ALL_REDUCE, dur, arg0=64 << 20, arg1=0x55D0_0000)
        rec.sleep(t + 200e-6, pid, wait, waker=0)  # the proxy thread wakes it when peers arrive
        if wait > 10 * NS_PER_MS and rec.rng.random() < 0.3:  # a short preemption while it waits anyway
            rec.sched(t + 200e-6 + wait / 1e9 + 100e-6, pid, 0.8 * NS_PER_MS, by=KWORKER)
        t += dur / 1e9 + 1.5e-3
        rec.sleep(t, pid, rec.jitter(1 * NS_PER_MS, 0.1))
        t += 1.1e-3
    _noise(rec, pid, seconds)
    return rec


def recompiling(base_ns: int, seed: int) -> SyntheticNode:
    """torch.compile meets new batch shapes: every ~4 s, four new kernels are generated and JIT-loaded
    on their first launch (~150-400 ms each) — in the middle of the run."""
    pid, seconds = 5300, 40.0
    rec = _rec("recompile-node", base_ns, seed, pid, "python3 train.py --compile")
    seen: set[int] = set()
    t, shape = 0.3, 0
    while t < seconds:
        if t > 12.0 + 4.0 * shape:
            shape += 1
            for k in range(4):  # the new shape's kernels
                fn = 0x7F3B_0000_0000 + 0x1000 * shape + 0x40 * k
                dur = float(rec.rng.uniform(150, 400)) * NS_PER_MS
                rec.ev(t, pid, *LAUNCH, dur, arg0=fn)
                rec.sleep(t + 1e-3, pid, dur * 0.3, waker=0)  # waiting on the compiler's files
                t += dur / 1e9 + 1e-4
        t = _launches(rec, t, pid, seen)
        t = _sync(rec, t, pid, 8.0)
        rec.sleep(t, pid, rec.jitter(1 * NS_PER_MS, 0.1))
        t += 1.1e-3
    _noise(rec, pid, seconds)
    return rec


def disk_bound(base_ns: int, seed: int) -> SyntheticNode:
    """No DataLoader workers: the training loop reads each batch from disk itself (~20 ms in
    uninterruptible sleep per step) while the GPU waits."""
    pid, seconds = 5500, 30.0
    rec = _rec("disk-node", base_ns, seed, pid, "python3 train.py --num-workers 0")
    seen: set[int] = set()
    t = 0.3
    while t < seconds:
        read = rec.jitter(20 * NS_PER_MS, 0.2)
        rec.block_io(t + read / 2e9, pid, False, read * 0.8, 2048)
        rec.sched(t, pid, read, state=2)  # D state: waiting for the read
        t += read / 1e9 + 100e-6
        t = _copy(rec, t, pid)
        t = _launches(rec, t, pid, seen)
        t = _sync(rec, t, pid, 12.0)
    _noise(rec, pid, seconds)
    return rec


def runqueue_contention(base_ns: int, seed: int) -> SyntheticNode:
    """From t=10 s a preprocessing job shares the trainer's cores. The trainer sleeps inside its blocking
    syncs as always; when the GPU is done and it is woken, it waits in the run queue while the job runs
    (wakeup → switch delay: involuntary), so its syncs return late."""
    pid, hog, seconds, start = 5600, 6200, 30.0, 10.0
    rec = _rec("runqueue-node", base_ns, seed, pid, "python3 train.py")
    rec.process(hog, "python3 preprocess.py --workers 16", start - 0.2)
    seen: set[int] = set()
    t = 0.3
    while t < seconds:
        t = _launches(rec, t, pid, seen)
        gpu = rec.jitter(9 * NS_PER_MS, 0.05)
        delay = float(rec.rng.uniform(8, 30)) * NS_PER_MS if t >= start and rec.rng.random() < 0.5 else 0.0
        rec.ev(t, pid, *STREAM_SYNC, gpu + delay)
        t_sleep = t + 100e-6
        asleep = gpu - 150 * NS_PER_US
        rec.ev(t_sleep + asleep / 1e9, pid, *SCHED_WAKEUP, asleep, arg0=0, arg1=0)  # woken when the GPU is done
        rec.sched(t_sleep, pid, asleep + delay, state=1, by=hog if delay else 0)  # ... back on a CPU later
        t += (gpu + delay) / 1e9 + 50e-6
        rec.sleep(t, pid, rec.jitter(1.5 * NS_PER_MS, 0.1))
        t += 1.6e-3
    _noise(rec, pid, seconds)
    return rec
