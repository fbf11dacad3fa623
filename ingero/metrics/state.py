"""The running totals behind every exported metric, updated with numpy a few drained batches at a time.

:meth:`MetricState.observe` takes an event array (``ingero.agent.trace.ringbuf.EVENT_DTYPE``) as the
pipeline drains it — every event, before selective storage — and folds it into per-op arrays with a
handful of ``bincount`` calls: no Python work per event. The batches are folded back to back every
:data:`FOLD_AFTER_S` (or :data:`FOLD_EVENTS` events), not one by one as they come: a fold's fixed cost
(some 80 numpy calls, on caches the 50 ms since the last drain left cold) is most of its CPU at
100 k events/s, so it is paid once for ten batches. Every read folds what is pending first, so a
snapshot is exact. :meth:`MetricState.snapshot` (called from a
scrape thread or the OTLP pusher) copies the totals under a lock and labels them. Numbers that live
elsewhere (the pipeline's stored/lost counters, the database size, chains) come from *providers*
registered with :meth:`MetricState.add_provider`, read at snapshot time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ingero import __version__
from ingero.agent.trace.recorder import BYTES_OPS, OP_NCCL_COMM_INIT
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.identity import Identity
from ingero.metrics import registry as r
from ingero.store import catalog

if TYPE_CHECKING:
    from ingero.metrics.engine_series import EngineFamily

MAX_SLOTS = 128  # distinct (source, op) pairs; the catalog has ~40
FOLD_AFTER_S = 0.5  # a batch handed to observe is folded in at most this late (or at the next read)
FOLD_EVENTS = 100_000  # ... or once this many events wait (6.4 MB of records)
_BOUNDS_NS = np.array([round(b * 1e9) for b in r.DURATION_BUCKETS_S], dtype=np.uint64)
NB = len(r.DURATION_BUCKETS_S) + 1  # + the +Inf bucket
HISTOGRAM_SOURCES = frozenset({catalog.CUDA, catalog.DRIVER, catalog.NCCL, catalog.IO, catalog.NET})
GPU_SOURCES = catalog.GPU_API_SOURCES
SCHED_SWITCH = catalog.op_id("sched_switch")
_BYTES = np.zeros(1 << 16, dtype=bool)
_BYTES[[s << 8 | o for s, o in BYTES_OPS]] = True
_HIST = np.zeros(1 << 16, dtype=bool)
_HIST[[s << 8 | o for s in HISTOGRAM_SOURCES for o in range(256)]] = True
_REL_BITS = 40  # a batch spans far less than 2^40 ns (18 min); the pid's group number sits above
_REL_MASK = (1 << _REL_BITS) - 1
_NO_MIN = np.full(MAX_SLOTS, np.iinfo(np.uint64).max, dtype=np.uint64)
_SOURCE_NAMES = {sid: name for sid, name, _ in catalog.SOURCES}
_OP_NAMES = {(s, o): name for s, o, name, _ in catalog.OPS}

# observe reads the record's source and op bytes as one little-endian uint16, ``op << 8 | source``
# (a *key*; labels and the public API use the code ``source << 8 | op``).
_FIELDS = EVENT_DTYPE.fields
assert _FIELDS is not None and _FIELDS["op"][1] == _FIELDS["source"][1] + 1 and _FIELDS["source"][1] % 2 == 0
_KEY_COL = _FIELDS["source"][1] // 2  # the key's column in the records viewed as uint16
_KEYS_PER_EVENT = EVENT_DTYPE.itemsize // 2
_CONTROL_KEY = OP_NCCL_COMM_INIT << 8  # keys from here up are control records
_GPU_KEY = np.zeros(1 << 16, dtype=bool)
_GPU_KEY[[o << 8 | s for s in GPU_SOURCES for o in range(256)]] = True
_NCCL_KEY = np.zeros(1 << 16, dtype=bool)
_NCCL_KEY[[o << 8 | catalog.NCCL for o in range(256)]] = True
_SCHED_KEY = SCHED_SWITCH[1] << 8 | SCHED_SWITCH[0]


def _key_to_code(key: int) -> int:
    return (key & 0xFF) << 8 | key >> 8


def _bucket_tables() -> tuple[np.ndarray, np.ndarray]:
    """Histogram bucket by the float64 exponent of a duration. Consecutive bounds are ≥ 2x apart, so
    an octave [2^k, 2^k+1) holds at most one: bucket = bounds below the octave + (d > its bound).
    Converting to float64 may round d up to 2^(k+1), never past a bound (all < 2^53). Checked
    against ``searchsorted(_BOUNDS_NS, d, side="left")`` (le buckets) in the tests."""
    below = np.zeros(2048, dtype=np.intp)
    bound = np.full(2048, np.iinfo(np.uint64).max, dtype=np.uint64)
    bounds = _BOUNDS_NS.tolist()
    assert all(b * 2 <= c for b, c in itertools.pairwise(bounds)) and bounds[-1] < 1 << 53
    for e in range(1023, 1088):  # biased exponents of 1 … 2^64; 0 is d == 0
        lo = 2 ** (e - 1023)
        below[e] = sum(1 for b in bounds if b < lo)
        inside = [b for b in bounds if lo <= b < 2 * lo]
        if inside:
            bound[e] = inside[0]
    return below, bound


_BUCKET_BELOW, _BUCKET_BOUND = _bucket_tables()


def duration_buckets(dur: np.ndarray) -> np.ndarray:
    """Each duration's histogram bucket (uint64 ns; a value equal to a bound is in it)."""
    exp = dur.astype(np.float64).view(np.int64) >> 52
    out: np.ndarray = _BUCKET_BELOW.take(exp) + (dur > _BUCKET_BOUND.take(exp))
    return out


Provider = Callable[[], list[r.Sample]]
EngineProvider = Callable[[], "list[EngineFamily]"]


@dataclass
class _Comm:
    label: str
    rank: int
    size: int
    calls: int = 0
    wait_ns: int = 0


@dataclass
class _Lut:
    """Slot per op, looked up by the record's key (``op << 8 | source``)."""

    slot_of: np.ndarray = field(default_factory=lambda: np.full(1 << 16, -1, dtype=np.intp))
    codes: list[int] = field(default_factory=list)  # slot -> code (source << 8 | op)

    def slots(self, key: np.ndarray) -> np.ndarray:
        s: np.ndarray = self.slot_of.take(key)
        if s.min() < 0:
            for k in sorted(np.unique(key[s < 0]).tolist(), key=_key_to_code):  # in code order
                if len(self.codes) < MAX_SLOTS - 1:
                    self.slot_of[k] = len(self.codes)
                    self.codes.append(_key_to_code(k))
                else:  # never with the catalog's ops; keeps a bad record from growing the arrays
                    self.slot_of[k] = MAX_SLOTS - 1
            s = self.slot_of.take(key)
        return s

    def slot(self, code: int) -> int:
        return int(self.slots(np.array([_key_to_code(code)]))[0])  # the swap is its own inverse


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
        self._hist_min_ns = _NO_MIN.copy()
        self._hist_max_ns = np.zeros(MAX_SLOTS, dtype=np.uint64)
        self._offcpu_ns = np.zeros(len(r.OFFCPU_STATES), dtype=np.int64)
        self._gpu_idle_ns = 0
        self._gpu_pids = np.zeros(0, dtype=np.int64)  # sorted: every pid that made a GPU call
        self._gpu_ends = np.zeros(0, dtype=np.int64)  # the end of its latest GPU call
        self._comms: dict[tuple[int, int], _Comm] = {}  # (pid, comm pointer) -> its labels and totals
        self._comm_seq: dict[int, int] = {}  # pid -> communicators it created so far
        self._providers: list[Provider] = []
        self._engine_providers: list[EngineProvider] = []
        self.batches = 0
        self._pending: list[np.ndarray] = []  # batches handed to observe, not yet folded (in order)
        self._pending_events = 0
        self._pending_since = 0.0  # monotonic time the oldest pending batch came
        self._pending_lock = threading.Lock()  # the list; held for an append or a swap only
        self._fold_lock = threading.Lock()  # one fold at a time, in the order the batches came
        self.read_fold_cpu_s = 0.0  # CPU that reads spent folding pending batches (observe's, elsewhere)

    def add_provider(self, provider: Provider) -> None:
        self._providers.append(provider)

    def add_engine_provider(self, provider: EngineProvider) -> None:
        """The serving engines' families (:class:`ingero.metrics.engine_series.EngineReader`), read at snapshot time."""
        self._engine_providers.append(provider)

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
        """Take one drained batch; it is folded in with the batches pending beside it (see the module
        docstring). The state keeps the array until then: the caller must not modify it."""
        if ev.size == 0:
            return
        now = time.monotonic()
        with self._pending_lock:
            if not self._pending:
                self._pending_since = now
            self._pending.append(ev)
            self._pending_events += ev.size
            due = self._pending_events >= FOLD_EVENTS or now - self._pending_since >= FOLD_AFTER_S
        if due:
            self._fold_pending()

    def _fold_pending(self, *, reader: bool = False) -> None:
        """Fold every pending batch, in the order observe took them."""
        with self._fold_lock:
            t0 = time.thread_time()
            with self._pending_lock:
                work, self._pending, self._pending_events = self._pending, [], 0
            for ev in work:
                self._fold(ev)
            if reader:
                self.read_fold_cpu_s += time.thread_time() - t0

    def _fold(self, ev: np.ndarray) -> None:
        """Fold one batch in (numpy, per batch). Every per-slot total is computed for every event; the
        snapshot exports bytes only for byte ops and histograms only for timed sources."""
        ev = np.ascontiguousarray(ev)
        key = ev.view("<u2").reshape(-1, _KEYS_PER_EVENT)[:, _KEY_COL].astype(np.intp)
        if key.max() >= _CONTROL_KEY:
            control = key >= _CONTROL_KEY
            for e in ev[control].tolist():
                # (ts, duration, arg0, arg1, cgroup_id, pid, tid, ret, stack_id, source, op, ...)
                if e[10] == OP_NCCL_COMM_INIT and e[2]:  # arg0 comm, arg1 nranks << 32 | rank, cgroup_id comm id
                    self.register_comm(int(e[5]), int(e[2]), int(e[3]) & 0xFFFFFFFF, int(e[3]) >> 32, int(e[4]))
            ev = ev[~control]
            if ev.size == 0:
                return
            key = ev.view("<u2").reshape(-1, _KEYS_PER_EVENT)[:, _KEY_COL].astype(np.intp)
        slot = self._lut.slots(key)
        dur = ev["duration"].copy()  # each field once, contiguous (records are 64 bytes)
        arg0 = ev["arg0"]
        dur_f = dur.astype(np.float64)
        counts = np.bincount(slot, minlength=MAX_SLOTS)
        nbytes = np.bincount(slot, weights=arg0.astype(np.float64), minlength=MAX_SLOTS)
        hist = np.bincount(slot * NB + duration_buckets(dur), minlength=MAX_SLOTS * NB).reshape(MAX_SLOTS, NB)
        hsum = np.bincount(slot, weights=dur_f, minlength=MAX_SLOTS)
        hmin = _NO_MIN.copy()
        np.minimum.at(hmin, slot, dur)
        hmax = np.zeros(MAX_SLOTS, dtype=np.uint64)
        np.maximum.at(hmax, slot, dur)
        offcpu = self._offcpu(key == _SCHED_KEY, arg0, dur)
        gpu = _GPU_KEY.take(key)
        idle, pids, ends = self._gpu_idle(ev["pid"][gpu], ev["ts"][gpu], dur[gpu]) if gpu.any() else (0, None, None)
        nccl = _NCCL_KEY.take(key)
        comms = self._collectives(ev["pid"][nccl], ev["arg1"][nccl], dur_f[nccl]) if nccl.any() else []
        with self._lock:
            self._count += counts
            self._bytes += nbytes
            self._hist += hist
            self._hist_sum_ns += hsum
            np.minimum(self._hist_min_ns, hmin, out=self._hist_min_ns)
            np.maximum(self._hist_max_ns, hmax, out=self._hist_max_ns)
            self._offcpu_ns += offcpu
            self._gpu_idle_ns += idle
            if pids is not None and ends is not None:
                self._gpu_pids, self._gpu_ends = pids, ends
            for c, calls, wait_ns in comms:
                c.calls += calls
                c.wait_ns += wait_ns
            self.batches += 1

    @staticmethod
    def _offcpu(sw: np.ndarray, arg0: np.ndarray, dur_all: np.ndarray) -> np.ndarray:
        """Off-CPU time of sched_switch events by the switched-out task's state."""
        out = np.zeros(len(r.OFFCPU_STATES), dtype=np.int64)
        if not sw.any():
            return out
        state = arg0[sw]
        dur = dur_all[sw].astype(np.int64)
        runnable = (state == 0) | (state == 256)
        io = (state & 2) != 0
        out[0] = int(dur[runnable].sum())
        out[2] = int(dur[io & ~runnable].sum())
        out[1] = int(dur.sum()) - out[0] - out[2]
        return out

    def _gpu_idle(self, pid32: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """Gaps ≥ GPU_IDLE_MIN_GAP_NS between a process's GPU calls (overlapping calls of its threads
        merged), carried over from the previous batch per pid. Vectorised: the calls ordered by (pid,
        start) — none for one pid in time order, a stable radix sort of the pid offsets when the batch
        is in time order, else one argsort — then one running maximum of the call ends with the pid's
        offset in the high bits so that it restarts at every pid. Returns the idle total and the new
        (pids, last ends) arrays, which observe swaps in under the lock."""
        pid = pid32.astype(np.int64)  # fresh arrays, then updated in place (fewer cold cache lines)
        rel_start = ts.astype(np.int64)
        base = int(rel_start.min())
        lo_pid, hi_pid = int(pid.min()), int(pid.max())
        pid -= lo_pid  # < 2^22 (PID_MAX_LIMIT): fits above the 40 bits of time
        in_time_order = bool((rel_start[1:] >= rel_start[:-1]).all())
        rel_start -= base
        np.minimum(rel_start, _REL_MASK, out=rel_start)
        rel_end = np.minimum(dur, _REL_MASK).astype(np.int64)
        rel_end += rel_start
        if lo_pid != hi_pid or not in_time_order:
            if in_time_order and hi_pid - lo_pid < 1 << 16:
                order = np.argsort(pid.astype(np.uint16), kind="stable")  # radix sort
            else:
                order = np.argsort(pid << _REL_BITS | rel_start)
            pid, rel_start, rel_end = pid[order], rel_start[order], rel_end[order]
        first = np.empty(pid.size, dtype=bool)
        first[0] = True
        np.not_equal(pid[1:], pid[:-1], out=first[1:])
        firsts = np.flatnonzero(first)
        lasts = np.append(firsts[1:], pid.size) - 1
        pids = pid[firsts] + lo_pid  # ascending, like the carried pids
        known, carried = self._gpu_pids, self._gpu_ends
        at = np.minimum(np.searchsorted(known, pids), max(known.size - 1, 0))
        seen = known[at] == pids if known.size else np.zeros(pids.size, dtype=bool)
        last_end = np.where(seen, carried[at] if known.size else 0, 0)
        reach = np.minimum(rel_end, _REL_MASK, out=rel_end)
        # a call of an earlier batch still running keeps the GPU busy for this batch's calls too
        reach[firsts] = np.maximum(reach[firsts], np.clip(last_end - base, 0, _REL_MASK))  # unseen: 0 - base < 0
        pid <<= _REL_BITS
        reach |= pid
        np.maximum.accumulate(reach, out=reach)
        reach &= _REL_MASK
        prev = pid  # reused
        prev[1:] = reach[:-1]
        prev[firsts] = np.where(seen, last_end - base, rel_start[firsts])
        gaps = np.subtract(rel_start, prev, out=rel_start)
        total = int(gaps[gaps >= r.GPU_IDLE_MIN_GAP_NS].sum())
        ends = np.maximum(reach[lasts] + base, last_end)
        if seen.all():
            new_pids, new_ends = known, carried.copy()
            new_ends[at] = ends
        else:
            new_pids = np.concatenate((known, pids[~seen]))
            new_ends = np.concatenate((carried, ends[~seen]))
            order = np.argsort(new_pids)
            new_pids, new_ends = new_pids[order], new_ends[order]
            new_ends[np.searchsorted(new_pids, pids[seen])] = ends[seen]
        return total, new_pids, new_ends

    def _collectives(self, pid: np.ndarray, comm: np.ndarray, wait_f: np.ndarray) -> list[tuple[_Comm, int, int]]:
        """Calls and wait per (pid, communicator) of the batch's NCCL events."""
        key = pid.astype(np.uint64) << np.uint64(48) ^ comm
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        calls = np.bincount(inv).tolist()
        wait = np.bincount(inv, weights=wait_f).tolist()
        out = []
        for i, pk in enumerate(zip(pid[first].tolist(), comm[first].tolist(), strict=True)):
            c = self._comms.get(pk)
            if c is None:  # created before tracing started: known only by its calls
                with self._lock:
                    c = self._comms.setdefault(pk, _Comm("unknown", -1, 0))
            out.append((c, calls[i], int(wait[i])))
        return out

    def observe_batch_counts(self, code: int, count: int, nbytes: int) -> None:
        """Totals for one op known only in aggregate (page allocations, a database's event_aggregates)."""
        with self._lock:
            s = self._lut.slot(code)
            self._count[s] += count
            self._bytes[s] += nbytes

    def set_counts(self, totals: dict[int, tuple[int, int]]) -> None:
        """Replace the event and byte totals (op code -> (count, bytes)): exact aggregates win over rows."""
        self._fold_pending(reader=True)  # the rows observed before count under the aggregates, not on top
        with self._lock:
            for code, (count, nbytes) in totals.items():
                s = self._lut.slot(code)
                self._count[s] = count
                self._bytes[s] = nbytes

    # --- reading ---------------------------------------------------------------------------------

    def op_medians_ns(self, sources: Collection[int]) -> dict[int, int]:
        """For each op of ``sources`` with timed calls (``source << 8 | op``): the upper bound of the latency
        bucket that holds its median, in ns (an op whose median is in the +Inf bucket has none)."""
        self._fold_pending(reader=True)
        with self._lock:
            codes = list(self._lut.codes)
            hist = self._hist[: len(codes)].copy()
        out: dict[int, int] = {}
        for code, h in zip(codes, hist, strict=True):
            n = int(h.sum())
            if (code >> 8) in sources and n:
                b = int(np.searchsorted(np.cumsum(h), (n + 1) // 2))
                if b < _BOUNDS_NS.size:
                    out[code] = int(_BOUNDS_NS[b])
        return out

    def snapshot(self) -> r.Snapshot:
        self._fold_pending(reader=True)
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
            gpu_ends = self._gpu_ends.tolist()
            comms: dict[tuple[str, int, int], list[int]] = {}
            for c in self._comms.values():
                t = comms.setdefault((c.label, c.rank, c.size), [0, 0])
                t[0] += c.calls
                t[1] += c.wait_ns
        latest = max(gpu_ends, default=0)
        active = sum(1 for t in gpu_ends if t >= latest - r.GPU_ACTIVE_WINDOW_NS)
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
        engines = [f for provider in self._engine_providers for f in provider()]
        return r.Snapshot(samples, hists, self.start_ns, time.time_ns(), engines)

    def base_labels(self) -> tuple[str, str]:
        return (self.identity.node, "" if self.identity.rank is None else str(self.identity.rank))
