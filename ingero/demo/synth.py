"""Building blocks for synthetic traces: a per-node recorder that collects events, snapshots, process
names and stacks with a seeded RNG, and writes them through the real :class:`StoreWriter`.

Everything is deterministic for a given seed and base timestamp: the demo scenarios and the committed
``investigations/`` databases are built from these pieces.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ingero.agent.trace.stacks import fnv1a64, to_signed64
from ingero.identity import Identity
from ingero.store.catalog import op_id
from ingero.store.schema import AGGREGATE_BUCKET_NS
from ingero.store.writer import EventRow, StoreWriter
from ingero.timeutil import NS_PER_MS, NS_PER_S, NS_PER_US

# The ops the demo nodes emit, named by the catalog (the ids live only there).
MALLOC = op_id("cudaMalloc")
FREE = op_id("cudaFree")
LAUNCH = op_id("cudaLaunchKernel")
MEMCPY = op_id("cudaMemcpy")
MEMCPY_ASYNC = op_id("cudaMemcpyAsync")
STREAM_SYNC = op_id("cudaStreamSync")
CU_LAUNCH = op_id("cuLaunchKernel")
CU_MEM_ALLOC = op_id("cuMemAlloc")
SCHED_SWITCH = op_id("sched_switch")
SCHED_WAKEUP = op_id("sched_wakeup")
PROCESS_EXEC = op_id("process_exec")
PROCESS_FORK = op_id("process_fork")
BLOCK_READ = op_id("block_read")
BLOCK_WRITE = op_id("block_write")
TCP_RETRANSMIT = op_id("tcp_retransmit")
ALL_REDUCE = op_id("ncclAllReduce")

MINUTE_NS = AGGREGATE_BUCKET_NS
Snapshot = tuple[int, float, float, int, int, float]


@dataclass
class SyntheticNode:
    """Synthetic rows of one node. Times are seconds after ``base_ns``; durations are nanoseconds."""

    node: str
    base_ns: int
    seed: int
    rank: int | None = None
    world_size: int | None = None
    session: dict[str, Any] = field(default_factory=dict)
    events: list[EventRow] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    names: dict[int, tuple[str, int]] = field(default_factory=dict)
    stacks: dict[int, tuple[str, str]] = field(default_factory=dict)
    unstored: list[EventRow] = field(default_factory=list)  # counted in event_aggregates, not stored

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def ts(self, t_s: float) -> int:
        return self.base_ns + round(t_s * NS_PER_S)

    def ev(
        self,
        t_s: float,
        pid: int,
        source: int,
        op: int,
        dur_ns: float,
        *,
        tid: int | None = None,
        gpu: int = 0,
        arg0: int = 0,
        arg1: int = 0,
        ret: int = 0,
        stack: int = 0,
        store: bool = True,
    ) -> None:
        """One event; ``store=False``: seen by the recorder but not stored (selective storage samples
        high-rate ops): counted in ``event_aggregates`` only."""
        row = (self.ts(t_s), pid, tid or pid, source, op, max(0, round(dur_ns)), gpu, arg0, arg1, ret, stack, 0)
        (self.events if store else self.unstored).append(row)

    def process(self, pid: int, name: str, t_s: float, *, exec_event: bool = True) -> None:
        self.names[pid] = (name, self.ts(t_s))
        if exec_event:
            self.ev(t_s, pid, *PROCESS_EXEC, 0)

    def snapshot(self, t_s: float, cpu: float, mem: float, avail_mb: int, swap_mb: int = 0, load: float = 1.0) -> None:
        self.snapshots.append((self.ts(t_s), round(cpu, 2), round(mem, 2), avail_mb, swap_mb, round(load, 2)))

    def stack(self, frames: list[tuple[str, str]]) -> int:
        """Register a stack (symbol, library) and return its hash for events.stack_hash."""
        ips = [0x7F3A_0000_0000 + 0x1000 * (i + 1) + (fnv1a64(s.encode()) & 0xFFF) for i, (s, _) in enumerate(frames)]
        h = to_signed64(fnv1a64(b"".join(struct.pack("<Q", ip) for ip in ips)))
        self.stacks[h] = (
            json.dumps([hex(ip) for ip in ips], separators=(",", ":")),
            json.dumps([{"s": s, "f": f} for s, f in frames], separators=(",", ":")),
        )
        return h

    # --- common patterns ---------------------------------------------------------------------

    def jitter(self, mean: float, rel: float = 0.1) -> float:
        return float(max(mean * 0.2, self.rng.normal(mean, mean * rel)))

    def sched(
        self, t_s: float, pid: int, offcpu_ns: float, *, state: int = 0, by: int = 0, tid: int | None = None
    ) -> None:
        """Thread ``tid`` (default: the main thread) leaves the CPU at ``t_s`` for ``offcpu_ns``.

        Written as ingero's tracer does: one sched_switch row when it is back on a CPU (ts = back,
        duration = time off it), arg0 = prev_state (0 = preempted while runnable, 1 = asleep by itself,
        2 = uninterruptible I/O), arg1 = the tid that ran before it (``by``: the preemptor).
        """
        self.ev(t_s + offcpu_ns / NS_PER_S, pid, *SCHED_SWITCH, offcpu_ns, tid=tid, arg0=state, arg1=by)

    def sleep(self, t_s: float, pid: int, ns: float, *, waker: int = 0, tid: int | None = None) -> None:
        """A voluntary sleep (futex, poll, usleep) of ``ns``, woken by ``waker`` (a tgid; 0: a timer)."""
        self.ev(t_s + ns / NS_PER_S, pid, *SCHED_WAKEUP, ns, tid=tid, arg0=waker, arg1=waker)
        self.sched(t_s, pid, ns, state=1, by=0, tid=tid)

    def block_io(self, t_s: float, pid: int, write: bool, dur_ns: float, sectors: int) -> None:
        self.ev(
            t_s,
            pid,
            *(BLOCK_WRITE if write else BLOCK_READ),
            dur_ns,
            arg0=sectors,
            arg1=int(self.rng.integers(1 << 20, 1 << 30)),
        )

    def background(
        self, t0: float, t1: float, pid: int, per_s: float, offcpu_ns: float, *, state: int = 0, by: int = 0
    ) -> None:
        """Ordinary scheduling of ``pid``: ``per_s`` short off-CPU periods per second."""
        for t in np.sort(self.rng.uniform(t0, t1, int(per_s * (t1 - t0)))):
            self.sched(float(t), pid, self.jitter(offcpu_ns, 0.4), state=state, by=by)

    def snapshots_every(self, t0: float, t1: float, cpu: Callable[[float], float], mem: float = 42.0) -> None:
        total_mb = 64_000
        for t in np.arange(t0, t1, 1.0):
            c = min(100.0, max(0.0, cpu(float(t)) + float(self.rng.normal(0, 1.5))))
            m = mem + float(self.rng.normal(0, 0.3))
            self.snapshot(float(t), c, m, int(total_mb * (1 - m / 100)), 0, round(c / 100 * 16, 2))

    # --- output --------------------------------------------------------------------------------

    def sorted_events(self) -> list[EventRow]:
        return sorted(self.events, key=lambda e: (e[0], e[1], e[3], e[4]))

    def aggregates(self) -> list[tuple[int, ...]]:
        agg: dict[tuple[int, int, int, int], list[int]] = {}
        for e, kept in [(e, 1) for e in self.events] + [(e, 0) for e in self.unstored]:
            key = (e[0] // MINUTE_NS * MINUTE_NS, e[3], e[4], e[1])
            a = agg.get(key)
            if a is None:
                agg[key] = [1, kept, e[5], e[5], e[5], e[7]]
            else:
                a[0] += 1
                a[1] += kept
                a[2] += e[5]
                a[3] = min(a[3], e[5])
                a[4] = max(a[4], e[5])
                a[5] += e[7]
        return [(*k, *v) for k, v in sorted(agg.items())]

    def identity(self) -> Identity:
        return Identity(
            self.node, rank=self.rank, local_rank=0 if self.rank is not None else None, world_size=self.world_size
        )

    def slices(self, step_s: float) -> Iterator[tuple[float, list[EventRow]]]:
        """Events in consecutive slices of ``step_s`` seconds (for paced playback)."""
        rows = self.sorted_events()
        step = round(step_s * NS_PER_S)
        i = 0
        t = self.base_ns
        while i < len(rows):
            t += step
            j = i
            while j < len(rows) and rows[j][0] < t:
                j += 1
            yield (t - self.base_ns) / NS_PER_S, rows[i:j]
            i = j

    def write(self, path: str | Path, *, chains: list[dict[str, Any]] | None = None) -> int:
        """Write everything into ``path`` (one session), in one go. Returns the number of events."""
        rows = self.sorted_events()
        with StoreWriter(path, self.identity()) as w:
            start = rows[0][0] if rows else self.base_ns
            stop = rows[-1][0] if rows else self.base_ns
            sid = w.start_session(self.session, started_at=start)
            n = w.write_batch(
                rows,
                stacks=[(h, ips, fr) for h, (ips, fr) in sorted(self.stacks.items())],
                aggregates=self.aggregates(),
                snapshots=sorted(self.snapshots),
                process_names=[(p, n, seen) for p, (n, seen) in sorted(self.names.items())],
            )
            w.end_session(sid, {"events_seen": n + len(self.unstored), "events_stored": n}, stopped_at=stop)
            if chains:
                w.save_chains(chains)
        return n


# Typical durations (ns) of a healthy training step's calls.
LAUNCH_NS = 8 * NS_PER_US
DRIVER_LAUNCH_NS = 14 * NS_PER_US
MEMCPY_ASYNC_NS = 15 * NS_PER_US
MALLOC_NS = 90 * NS_PER_US
STEP_SYNC_NS = 5 * NS_PER_MS

TRAIN_STACK = [
    ("cudaLaunchKernel", "libcudart.so.12"),
    ("at::native::gemm", "libtorch_cuda.so"),
    ("torch::autograd::Engine::evaluate_function", "libtorch_cpu.so"),
]
ALLOC_STACK = [
    ("cudaMalloc", "libcudart.so.12"),
    ("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc", "libc10_cuda.so"),
    ("at::detail::empty_cuda", "libtorch_cuda.so"),
]
SESSION = {
    "gpu_model": "NVIDIA H100 80GB HBM3 (synthetic)",
    "gpu_driver": "550.54.15",
    "cpu_model": "Intel(R) Xeon(R) Platinum 8480+ (synthetic)",
    "cpu_cores": 16,
    "mem_total": 64_000,
    "kernel": "6.8.0-synthetic",
    "os_release": "Ubuntu 24.04 LTS",
    "cuda_ver": "12.4",
    "python_ver": "3.11",
    "flags": "synthetic",
}
__all__ = ["SESSION", "SyntheticNode"]
