"""The running totals behind every exported metric, updated per drained batch with numpy.

:meth:`MetricState.observe` takes an event array (``ingero.trace.ringbuf.EVENT_DTYPE``) as the
pipeline drains it — every event, before selective storage — and folds it into per-op arrays with a
handful of ``bincount`` calls: no Python work per event. :meth:`MetricState.snapshot` (called from a
scrape thread or the OTLP pusher) copies the totals under a lock and labels them. Numbers that live
elsewhere (the pipeline's stored/lost counters, the database size, chains) come from *providers*
registered with :meth:`MetricState.add_provider`, read at snapshot time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ingero import __version__
from ingero.identity import Identity
from ingero.metrics import registry as r
from ingero.store import catalog
from ingero.trace.recorder import BYTES_OPS, OP_NCCL_COMM_INIT

MAX_SLOTS = 128  # distinct (source, op) pairs; the catalog has ~40
_BOUNDS_NS = np.array([round(b * 1e9) for b in r.DURATION_BUCKETS_S], dtype=np.uint64)
NB = len(r.DURATION_BUCKETS_S) + 1  # + the +Inf bucket
HISTOGRAM_SOURCES = frozenset({catalog.CUDA, catalog.DRIVER, catalog.NCCL, catalog.IO, catalog.NET})
GPU_SOURCES = (catalog.CUDA, catalog.DRIVER, catalog.NCCL)
SCHED_SWITCH = catalog.op_id("sched_switch")
_BYTES = np.zeros(1 << 16, dtype=bool)
_BYTES[[s << 8 | o for s, o in BYTES_OPS]] = True
_GPU = np.zeros(1 << 16, dtype=bool)
_GPU[[s << 8 | o for s in GPU_SOURCES for o in range(256)]] = True
_REL_BITS = 40  # a batch spans far less than 2^40 ns (18 min); the pid's group number sits above
_REL_MASK = (1 << _REL_BITS) - 1
_HIST = np.zeros(1 << 16, dtype=bool)
_HIST[[s << 8 | o for s in HISTOGRAM_SOURCES for o in range(256)]] = True
_SOURCE_NAMES = {sid: name for sid, name, _ in catalog.SOURCES}
_OP_NAMES = {(s, o): name for s, o, name, _ in catalog.OPS}

Provider = Callable[[], list[r.Sample]]


@dataclass
class _Comm:
    label: str
    rank: int
    size: int
    calls: int = 0
    wait_ns: int = 0


@dataclass
class _Lut:
    slot_of: np.ndarray = field(default_factory=lambda: np.full(1 << 16, -1, dtype=np.int16))
    codes: list[int] = field(default_factory=list)

    def slots(self, code: np.ndarray) -> np.ndarray:
        s = self.slot_of[code]
        if (s < 0).any():
            for c in np.unique(code[s < 0]).tolist():
                if len(self.codes) < MAX_SLOTS - 1:
                    self.slot_of[c] = len(self.codes)
                    self.codes.append(int(c))
                else:  # never with the catalog's ops; keeps a bad record from growing the arrays
                    self.slot_of[c] = MAX_SLOTS - 1
            s = self.slot_of[code]
        out: np.ndarray = s.astype(np.int64)
        return out


def op_labels(code: int) -> tuple[str, str]:
    src, op = code >> 8, code & 0xFF
    return _SOURCE_NAMES.get(src, str(src)), _OP_NAMES.get((src, op), f"op{op}")


class MetricState:
    """Totals since start; thread-safe (one writer, any number of readers)."""

    def __init__(self, identity: Identity, mode: str) -> None:
        self.identity = identity
        self.mode = mode  # trace | serve
        self.start_ns = time.time_ns()
        self._lock = threading.Lock()
        self._lut = _Lut()
        self._count = np.zeros(MAX_SLOTS, dtype=np.int64)
        self._bytes = np.zeros(MAX_SLOTS, dtype=np.float64)
        self._hist = np.zeros((MAX_SLOTS, NB), dtype=np.int64)
        self._hist_sum_ns = np.zeros(MAX_SLOTS, dtype=np.float64)
        self._hist_min_ns = np.full(MAX_SLOTS, np.iinfo(np.uint64).max, dtype=np.uint64)
        self._hist_max_ns = np.zeros(MAX_SLOTS, dtype=np.uint64)
        self._offcpu_ns = np.zeros(len(r.OFFCPU_STATES), dtype=np.int64)
        self._gpu_idle_ns = 0
        self._last_gpu_end: dict[int, int] = {}  # pid -> end of its latest GPU call
        self._comms: dict[tuple[int, int], _Comm] = {}  # (pid, comm pointer) -> its labels and totals
        self._comm_seq: dict[int, int] = {}  # pid -> communicators it created so far
        self._providers: list[Provider] = []
        self.batches = 0

    def add_provider(self, provider: Provider) -> None:
        self._providers.append(provider)

    # --- feeding ---------------------------------------------------------------------------------

    def register_comm(self, pid: int, comm: int, rank: int, size: int, comm_id: int = 0) -> None:
        """A communicator a process created (ncclCommInitRank). Its label is the cluster-wide id
        (``comm_id``, splitmix64 of the ncclUniqueId: the same on every rank) as 16 hex digits when
        known, else its creation order in the process plus its size (``c0/8``), which every rank of an
        SPMD job shares too."""
        with self._lock:
            if (pid, comm) in self._comms:
                return
            k = self._comm_seq.get(pid, 0)
            self._comm_seq[pid] = k + 1
            label = f"{comm_id & 0xFFFFFFFFFFFFFFFF:016x}" if comm_id else f"c{k}/{size}"
            if len(self._comms) >= r.MAX_COMMS:
                label = "other"
            self._comms[(pid, comm)] = _Comm(label, rank, size)

    def observe(self, ev: np.ndarray) -> None:
        """Fold one drained batch in (numpy, per batch)."""
        if ev.size == 0:
            return
        control = ev["op"] >= OP_NCCL_COMM_INIT
        if control.any():
            for e in ev[control].tolist():
                # (ts, duration, arg0, arg1, cgroup_id, pid, tid, ret, stack_id, source, op, ...)
                if e[10] == OP_NCCL_COMM_INIT and e[2]:  # arg0 comm, arg1 nranks << 32 | rank, cgroup_id comm id
                    self.register_comm(int(e[5]), int(e[2]), int(e[3]) & 0xFFFFFFFF, int(e[3]) >> 32, int(e[4]))
            ev = ev[~control]
            if ev.size == 0:
                return
        code = ev["source"].astype(np.int64) << 8 | ev["op"]
        slot = self._lut.slots(code)
        dur = np.ascontiguousarray(ev["duration"])  # each field once, contiguous (records are 56 bytes)
        counts = np.bincount(slot, minlength=MAX_SLOTS)
        b = _BYTES[code]
        nbytes = (
            np.bincount(slot[b], weights=ev["arg0"][b].astype(np.float64), minlength=MAX_SLOTS) if b.any() else None
        )
        h = _HIST[code]
        hist = hsum = hs = hd = None
        if h.any():
            hs = slot[h]
            hd = dur[h]
            bucket = np.searchsorted(_BOUNDS_NS, hd, side="left")  # le: a value equal to a bound is in it
            hist = np.bincount(hs * NB + bucket, minlength=MAX_SLOTS * NB).reshape(MAX_SLOTS, NB)
            hsum = np.bincount(hs, weights=hd.astype(np.float64), minlength=MAX_SLOTS)
        offcpu = self._offcpu(ev, code, dur)
        idle, ends = self._gpu_idle(ev, code, dur)
        nccl = ev[ev["source"] == catalog.NCCL]
        with self._lock:
            self._count += counts
            if nbytes is not None:
                self._bytes += nbytes
            if hist is not None and hsum is not None and hs is not None and hd is not None:
                self._hist += hist
                self._hist_sum_ns += hsum
                np.minimum.at(self._hist_min_ns, hs, hd)
                np.maximum.at(self._hist_max_ns, hs, hd)
            self._offcpu_ns += offcpu
            self._gpu_idle_ns += idle
            self._last_gpu_end.update(ends)
            self.batches += 1
        if nccl.size:
            self._collectives(nccl)

    @staticmethod
    def _offcpu(ev: np.ndarray, code: np.ndarray, dur_all: np.ndarray) -> np.ndarray:
        out = np.zeros(len(r.OFFCPU_STATES), dtype=np.int64)
        sw = code == (SCHED_SWITCH[0] << 8 | SCHED_SWITCH[1])
        if not sw.any():
            return out
        state = ev["arg0"][sw]
        dur = dur_all[sw].astype(np.int64)
        runnable = (state == 0) | (state == 256)
        io = (state & 2) != 0
        out[0] = int(dur[runnable].sum())
        out[2] = int(dur[io & ~runnable].sum())
        out[1] = int(dur.sum()) - out[0] - out[2]
        return out

    def _gpu_idle(self, ev: np.ndarray, code: np.ndarray, dur: np.ndarray) -> tuple[int, dict[int, int]]:
        """Gaps ≥ GPU_IDLE_MIN_GAP_NS between a process's GPU calls (overlapping calls of its threads
        merged), carried over from the previous batch per pid. Vectorised: one sort by (pid, start),
        one running maximum of the call ends with the pid's group number in the high bits so that it
        restarts at every pid."""
        gpu = _GPU[code]
        if not gpu.any():
            return 0, {}
        pid = ev["pid"][gpu].astype(np.int64)
        start = ev["ts"][gpu].astype(np.int64)
        base = int(start.min())
        rel_start = np.minimum(start - base, _REL_MASK)
        rel_end = rel_start + np.minimum(dur[gpu], _REL_MASK).astype(np.int64)
        key = pid << _REL_BITS | rel_start
        if not bool((key[1:] >= key[:-1]).all()):
            order = np.argsort(key)
            pid, rel_start, rel_end = pid[order], rel_start[order], rel_end[order]
        first = np.concatenate(([True], pid[1:] != pid[:-1]))
        group = np.cumsum(first) - 1
        reach = np.maximum.accumulate(group << _REL_BITS | np.minimum(rel_end, _REL_MASK)) & _REL_MASK
        prev = np.empty_like(reach)
        prev[1:] = reach[:-1]
        firsts = np.flatnonzero(first)
        lasts = np.append(firsts[1:] - 1, pid.size - 1)
        pids = pid[firsts].tolist()
        carried = [self._last_gpu_end.get(p) for p in pids]
        prev[firsts] = [rel_start[f] if c is None else c - base for f, c in zip(firsts.tolist(), carried, strict=True)]
        gaps = rel_start - prev
        total = int(gaps[gaps >= r.GPU_IDLE_MIN_GAP_NS].sum())
        ends = {
            p: max(int(e) + base, c or 0) for p, e, c in zip(pids, reach[lasts].tolist(), carried, strict=True)
        }  # applied under the lock by observe (snapshots read the dict)
        return total, ends

    def _collectives(self, nccl: np.ndarray) -> None:
        key = nccl["pid"].astype(np.uint64) << np.uint64(48) ^ nccl["arg1"]
        uniq, inv = np.unique(key, return_inverse=True)
        calls = np.bincount(inv)
        wait = np.bincount(inv, weights=nccl["duration"].astype(np.float64))
        first = np.zeros(uniq.size, dtype=np.int64)
        first[inv[::-1]] = np.arange(inv.size)[::-1]
        with self._lock:
            for i, f in enumerate(first.tolist()):
                pk = (int(nccl["pid"][f]), int(nccl["arg1"][f]))
                c = self._comms.get(pk)
                if c is None:  # created before tracing started: known only by its calls
                    c = self._comms.setdefault(pk, _Comm("unknown", -1, 0))
                c.calls += int(calls[i])
                c.wait_ns += int(wait[i])

    def observe_batch_counts(self, code: int, count: int, nbytes: int) -> None:
        """Totals for one op known only in aggregate (page allocations, a database's event_aggregates)."""
        with self._lock:
            s = int(self._lut.slots(np.array([code]))[0])
            self._count[s] += count
            self._bytes[s] += nbytes

    def set_counts(self, totals: dict[int, tuple[int, int]]) -> None:
        """Replace the event and byte totals (op code -> (count, bytes)): exact aggregates win over rows."""
        with self._lock:
            for code, (count, nbytes) in totals.items():
                s = int(self._lut.slots(np.array([code]))[0])
                self._count[s] = count
                self._bytes[s] = nbytes

    # --- reading ---------------------------------------------------------------------------------

    def snapshot(self) -> r.Snapshot:
        base = self.base_labels()
        with self._lock:
            codes = list(self._lut.codes)
            count = self._count.copy()
            nbytes = self._bytes.copy()
            hist = self._hist.copy()
            hsum = self._hist_sum_ns.copy()
            hmin = self._hist_min_ns.copy()
            hmax = self._hist_max_ns.copy()
            offcpu = self._offcpu_ns.tolist()
            idle = self._gpu_idle_ns
            latest = max(self._last_gpu_end.values(), default=0)
            active = sum(1 for t in self._last_gpu_end.values() if t >= latest - r.GPU_ACTIVE_WINDOW_NS)
            comms: dict[tuple[str, int, int], list[int]] = {}
            for c in self._comms.values():
                t = comms.setdefault((c.label, c.rank, c.size), [0, 0])
                t[0] += c.calls
                t[1] += c.wait_ns
        samples = [r.Sample(r.INFO, (*base, __version__, self.mode), 1.0)]
        hists: list[r.HistogramSample] = []
        for s, code in enumerate(codes):
            src, op = op_labels(code)
            if count[s]:
                samples.append(r.Sample(r.EVENTS, (*base, src, op), float(count[s])))
            if _BYTES[code]:
                samples.append(r.Sample(r.BYTES, (*base, src, op), float(nbytes[s])))
            if _HIST[code] and hist[s].any():
                hists.append(
                    r.HistogramSample(
                        r.DURATION,
                        (*base, src, op),
                        tuple(hist[s].tolist()),
                        float(hsum[s]) / 1e9,
                        int(hmin[s]) / 1e9,
                        int(hmax[s]) / 1e9,
                    )
                )
        for state, ns in zip(r.OFFCPU_STATES, offcpu, strict=True):
            samples.append(r.Sample(r.OFFCPU, (*base, state), ns / 1e9))
        samples.append(r.Sample(r.GPU_IDLE, base, idle / 1e9))
        samples.append(r.Sample(r.GPU_PROCESSES, base, float(active)))
        for (label, rank, size), (calls, wait_ns) in sorted(comms.items()):
            lab = (*base, label, str(rank), str(size))
            samples.append(r.Sample(r.COLLECTIVES, lab, float(calls)))
            samples.append(r.Sample(r.COLLECTIVE_WAIT, lab, wait_ns / 1e9))
        for provider in self._providers:
            samples.extend(provider())
        return r.Snapshot(samples, hists, self.start_ns, time.time_ns())

    def base_labels(self) -> tuple[str, str]:
        return (self.identity.node, "" if self.identity.rank is None else str(self.identity.rank))
