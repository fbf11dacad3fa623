"""The six ``ingero demo`` scenarios: synthetic but physically coherent traces of classic GPU incidents.

Each builder returns a :class:`~ingero.demo.synth.SyntheticNode` for one node; effects are caused, not
painted on: a CUDA call is slow *because* its thread was off-CPU for that long (and the sched_switch
row says so), a launch rate falls *because* the launching thread gets half a CPU, and so on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ingero.demo.synth import (
    ALLOC_STACK,
    FREE,
    LAUNCH,
    LAUNCH_NS,
    MALLOC,
    MALLOC_NS,
    MEMCPY,
    MEMCPY_ASYNC,
    MEMCPY_ASYNC_NS,
    SESSION,
    STREAM_SYNC,
    TRAIN_STACK,
    SyntheticNode,
)
from ingero.timeutil import NS_PER_MS, NS_PER_US

NODE = "demo-node"
Builder = Callable[[int, int], SyntheticNode]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    story: str
    expect: str  # the chain explain must produce
    build: Builder
    seconds: float


def _rec(base_ns: int, seed: int) -> SyntheticNode:
    rec = SyntheticNode(NODE, base_ns, seed)
    rec.session = dict(SESSION)
    return rec


def incident(base_ns: int, seed: int) -> SyntheticNode:
    """CPU spike + sched_switch storm (stress-ng) → cudaStreamSync tail ~8x."""
    rec = _rec(base_ns, seed)
    pid, storm = 4242, (10.0, 20.0)
    rec.process(pid, "python3 train.py", 0.0, exec_event=False)
    rec.process(5150, "stress-ng --cpu 16", storm[0] - 0.3)
    launch_stack, alloc_stack = rec.stack(TRAIN_STACK), rec.stack(ALLOC_STACK)
    rng = rec.rng
    t, i = 0.2, 0
    while t < 30.0:
        for k in range(4):
            rec.ev(t + k * 25e-6, pid, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15), stack=launch_stack if k == 0 else 0)
        rec.ev(t + 120e-6, pid, *MEMCPY_ASYNC, rec.jitter(MEMCPY_ASYNC_NS), arg0=4 << 20, arg1=1)
        if i % 50 == 0:
            rec.ev(t + 150e-6, pid, *MALLOC, rec.jitter(MALLOC_NS), arg0=64 << 20, stack=alloc_stack)
        sync = rec.jitter(5 * NS_PER_MS, 0.06)
        if storm[0] <= t < storm[1] and rng.random() < 0.5:
            off = float(rng.uniform(12, 38)) * NS_PER_MS
            rec.sched(t + 250e-6, pid, off, by=5150)  # preempted while waiting: the sync returns that much later
            sync += off
        rec.ev(t + 250e-6, pid, *STREAM_SYNC, sync)
        t += 250e-6 + sync / 1e9 + rec.jitter(1.2 * NS_PER_MS) / 1e9
        i += 1
    rec.background(0.0, 30.0, pid, 2, 40 * NS_PER_US)
    rec.background(storm[0], storm[1], pid, 40, 2 * NS_PER_MS, by=5150)
    rec.snapshots_every(0.0, 30.0, lambda s: 97.5 if storm[0] <= s < storm[1] else 38.0)
    return rec


def cold_start(base_ns: int, seed: int) -> SyntheticNode:
    """An inference server restarted three times; each start pays CUDA initialisation again."""
    rec = _rec(base_ns, seed)
    for n, (pid, t0) in enumerate(((7001, 0.5), (7002, 8.5), (7003, 16.5))):
        rec.process(pid, f"python3 serve.py --worker {n}", t0 - 0.05)
        t, req = t0, 0
        while t < t0 + 7.5:
            cold = req < 10
            if req % 10 == 0 or cold:
                rec.ev(
                    t, pid, *MALLOC, rec.jitter(MALLOC_NS) * (rec.rng.uniform(50, 200) if req < 4 else 1), arg0=8 << 20
                )
            rec.ev(
                t + 1e-4,
                pid,
                *MEMCPY,
                40 * NS_PER_US * (rec.rng.uniform(50, 200) if cold else rec.jitter(1, 0.1)),
                arg0=1 << 20,
                arg1=1,
            )
            for k in range(3):
                slow = req < 7
                rec.ev(
                    t + 2e-4 + k * 2e-5,
                    pid,
                    *LAUNCH,
                    rec.jitter(LAUNCH_NS, 0.15) * (rec.rng.uniform(50, 200) if slow else 1),
                )
            sync = rec.jitter(3 * NS_PER_MS, 0.05)
            rec.ev(t + 3e-4, pid, *STREAM_SYNC, sync)
            rec.ev(t + 3e-4 + sync / 1e9, pid, *MEMCPY, rec.jitter(20 * NS_PER_US), arg0=64 << 10, arg1=2)
            t += 0.02 + (0.08 if cold else 0.0)
            req += 1
        rec.background(t0, t0 + 7.5, pid, 2, 40 * NS_PER_US)
    rec.snapshots_every(0.0, 24.0, lambda s: 30.0)
    return rec


def memcpy_bottleneck(base_ns: int, seed: int) -> SyntheticNode:
    """A training loop that copies 64 MB of pageable memory per step: cudaMemcpy dominates wall time."""
    rec = _rec(base_ns, seed)
    pid = 4343
    rec.process(pid, "python3 train.py", 0.0, exec_event=False)
    t = 0.2
    while t < 20.0:
        h2d = (64 << 20) / 3.1e9 * 1e9 * rec.jitter(1.0, 0.04)  # ~3.1 GB/s: pageable host memory
        rec.ev(t, pid, *MEMCPY, h2d, arg0=64 << 20, arg1=1)
        t += h2d / 1e9
        for k in range(4):
            rec.ev(t + k * 25e-6, pid, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15))
        sync = rec.jitter(4 * NS_PER_MS, 0.05)
        rec.ev(t + 1e-4, pid, *STREAM_SYNC, sync)
        t += 1e-4 + sync / 1e9
        d2h = rec.jitter(110 * NS_PER_US, 0.1)
        rec.ev(t, pid, *MEMCPY, d2h, arg0=256 << 10, arg1=2)
        t += d2h / 1e9 + 0.6e-3
    rec.background(0.0, 20.0, pid, 2, 40 * NS_PER_US)
    rec.snapshots_every(0.0, 20.0, lambda s: 35.0)
    return rec


def periodic_spike(base_ns: int, seed: int) -> SyntheticNode:
    """cudaMalloc spikes every 200 batches (the loop calls torch.cuda.empty_cache() every 200 steps)."""
    rec = _rec(base_ns, seed)
    pid = 4444
    rec.process(pid, "python3 train.py", 0.0, exec_event=False)
    alloc_stack = rec.stack(ALLOC_STACK)
    t, batch = 0.2, 0
    while t < 26.0:
        if batch % 200 == 199:
            for k in range(8):  # torch.cuda.empty_cache(): the cached blocks go back to the driver at once
                rec.ev(t, pid, *FREE, rec.jitter(300 * NS_PER_US, 0.2), arg0=0x7F00_0000 + k * 0x1000)
                t += 0.35e-3
            for _ in range(6):  # the cache was just emptied: every block comes from the driver again
                d = float(rec.rng.uniform(20, 45)) * NS_PER_MS
                rec.ev(t, pid, *MALLOC, d, arg0=256 << 20, stack=alloc_stack)
                t += d / 1e9
        rec.ev(t, pid, *MALLOC, rec.jitter(80 * NS_PER_US, 0.12), arg0=32 << 20, stack=alloc_stack)
        for k in range(4):
            rec.ev(t + 1e-4 + k * 25e-6, pid, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15))
        sync = rec.jitter(10 * NS_PER_MS, 0.05)
        rec.ev(t + 2e-4, pid, *STREAM_SYNC, sync)
        t += 2e-4 + sync / 1e9 + 1.5e-3
        batch += 1
    rec.background(0.0, 26.0, pid, 2, 40 * NS_PER_US)
    rec.snapshots_every(0.0, 26.0, lambda s: 40.0)
    return rec


def cpu_contention(base_ns: int, seed: int) -> SyntheticNode:
    """A launch-bound trainer; at t=10 s a 'make -j32' build takes half its CPU: launch rate halves."""
    rec = _rec(base_ns, seed)
    pid, hog = 4545, 10.0
    rec.process(pid, "python3 train.py", 0.0, exec_event=False)
    rec.process(6100, "make -j32", hog - 0.2)
    t = 0.2
    while t < 30.0:
        share = 0.46 if t >= hog else 1.0  # fraction of wall time the launching thread gets a CPU
        for _ in range(24):
            rec.ev(t, pid, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15))
            t += rec.jitter(0.5 * NS_PER_MS, 0.1) / 1e9 / share
        sync = rec.jitter(1 * NS_PER_MS, 0.05)
        rec.ev(t, pid, *STREAM_SYNC, sync)
        t += sync / 1e9
    rec.background(0.0, 30.0, pid, 2, 40 * NS_PER_US)
    rec.background(hog, 30.0, pid, 150, 3.6 * NS_PER_MS, by=6100)  # 150 preemptions/s x 3.6 ms ≈ 54 % off-CPU
    rec.snapshots_every(0.0, 30.0, lambda s: 99.0 if s >= hog else 45.0)
    return rec


def gpu_steal(base_ns: int, seed: int) -> SyntheticNode:
    """A second process (eval.py) shares GPU 0 from t=10 s to t=22 s: time-slicing slows the trainer 2.8x."""
    rec = _rec(base_ns, seed)
    trainer, evaler, window = 4646, 4747, (10.0, 22.0)
    rec.process(trainer, "python3 train.py", 0.0, exec_event=False)
    rec.process(evaler, "python3 eval.py", window[0] - 0.1)
    t = 0.2
    while t < 30.0:
        shared = window[0] <= t < window[1]
        for k in range(4):
            rec.ev(t + k * 25e-6, trainer, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15))
        sync = rec.jitter(6 * NS_PER_MS, 0.05) * (2.8 if shared else 1.0)
        rec.ev(t + 1e-4, trainer, *STREAM_SYNC, sync)
        t += 1e-4 + sync / 1e9 + 0.5e-3
    t = window[0]
    while t < window[1]:
        for k in range(3):
            rec.ev(t + k * 25e-6, evaler, *LAUNCH, rec.jitter(LAUNCH_NS, 0.15))
        sync = rec.jitter(5 * NS_PER_MS, 0.05) * 2.5
        rec.ev(t + 1e-4, evaler, *STREAM_SYNC, sync)
        t += 1e-4 + sync / 1e9 + 0.4e-3
    rec.background(0.0, 30.0, trainer, 2, 40 * NS_PER_US)
    rec.snapshots_every(0.0, 30.0, lambda s: 33.0)
    return rec


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "incident",
            "CPU spike + sched_switch storm stalls cudaStreamSynchronize",
            "stress-ng starts on the training node; for 8 s the trainer is preempted hundreds of times",
            "HIGH tail/cpu on cudaStreamSync: GPU thread preempted by stress-ng during its slow calls (measured overlap), fix CPU pinning (taskset)",
            incident,
            30.0,
        ),
        Scenario(
            "cold-start",
            "first CUDA calls 50-200x slower after each process start",
            "an inference server is restarted three times and pays CUDA initialisation every time",
            "MEDIUM cold-start: warm-up iterations, persistent workers, persistence mode",
            cold_start,
            24.0,
        ),
        Scenario(
            "memcpy-bottleneck",
            "cudaMemcpy dominates wall time",
            "each step copies 64 MB from pageable host memory at ~3 GB/s before a 4 ms kernel",
            "HIGH transfer on cudaMemcpy: pinned memory, async copies on a stream",
            memcpy_bottleneck,
            20.0,
        ),
        Scenario(
            "periodic-spike",
            "cudaMalloc spikes every ~200 batches",
            "the loop empties the CUDA cache every 200 steps, so the allocator goes back to the driver",
            "MEDIUM periodic on cudaMalloc: no empty_cache() in the loop, static shapes",
            periodic_spike,
            26.0,
        ),
        Scenario(
            "cpu-contention",
            "a parallel build halves the trainer's kernel-launch rate",
            "make -j32 starts at t=10 s; the launch-bound trainer gets half a CPU",
            "HIGH drop/cpu on cudaLaunchKernel: pin the trainer (taskset), nice the build",
            cpu_contention,
            30.0,
        ),
        Scenario(
            "gpu-steal",
            "a second process time-slices the GPU",
            "eval.py shares GPU 0 with the trainer from t=10 s to t=22 s",
            "HIGH gpu-contention on cudaStreamSync: one GPU per job (CUDA_VISIBLE_DEVICES) or MPS/MIG",
            gpu_steal,
            30.0,
        ),
    )
}
