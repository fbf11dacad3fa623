"""The recording pipeline: drain on a timer -> bounded channel -> the store's single writer.

* **drain** (trio task, every ``drain_interval_s`` while busy): reads every record the ring buffer
  holds (:class:`~ingero.agent.trace.ringbuf.RingReader`, a memory copy — ~0.1 µs per event) into a
  pending batch. A busy drain (``flush_events`` records or more) sends the batch down a bounded trio
  memory channel at once, after feeding the live statistics and ``on_events``. Drains that find less
  double the wait, and past ``idle_drain_interval_s`` the drain rests: the housekeeping tick takes
  the trickle (an idle host's own block I/O, a process starting now and then) once a second, and a
  :class:`~ingero.agent.trace.ringwatch.RingWatch` thread wakes the drain when ``flush_events``
  records wait — so that at rest neither the drain nor the writer wakes more than once a second. When the channel is full the drain skips its
  turn and the records wait in the kernel ring buffer (16 MiB by default); if that overflows too, the
  kernel counts the loss (``events_dropped_ring``). Nothing is dropped silently.
* **housekeeping** (every second): a system snapshot, the kernel's page-allocation counters, the
  kernel drop counters and the pending events, handed to the writer together (one transaction);
  session stats every few seconds; size-based pruning with ``--max-db``.
* **writer** (trio task; the work runs in a worker thread via ``trio.to_thread``): turns everything
  received since its last turn into one :class:`~ingero.agent.trace.recorder.WriteBatch` (selective
  storage, aggregates, stacks, process names) and commits it in one transaction. When the disk is
  full (SQLITE_FULL) it prunes the oldest events as ``--max-db`` does and tries again; what could
  not be stored is counted (``rows_pruned_disk_full``, ``events_lost_disk_full``), and only when not
  even the aggregates fit does recording stop (:class:`~ingero.errors.DiskFullError`).

``request_stop()`` ends the drain after one last read; the writer then commits what is left and
:meth:`Pipeline.run` returns. The caller closes the session with :meth:`Pipeline.stats`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from ingero.agent.trace.livestats import LiveStats
from ingero.agent.trace.recorder import PAGE_ALLOC, Recorder, WriteBatch, monotonic_offset_ns
from ingero.agent.trace.ringwatch import RingWatch
from ingero.agent.trace.sysinfo import SnapshotSampler
from ingero.errors import DiskFullError
from ingero.store import catalog
from ingero.store.writer import StoreWriter
from ingero.timeutil import now_ns

DISK_FULL_ATTEMPTS = 3  # full batch, full batch after pruning, aggregates only after pruning more


class EventSource(Protocol):
    """What the pipeline needs from the probes (:class:`~ingero.agent.trace.probes.BpfProbes`)."""

    def read_events(self) -> np.ndarray: ...

    def counters(self) -> dict[str, int]: ...

    def page_allocs(self) -> dict[int, tuple[int, int]]: ...

    def pending_records(self) -> int: ...

    def peek_events(self, since: int) -> tuple[np.ndarray, int]: ...


# Records that may not wait for the housekeeping tick: a traced process's GPU calls (their stacks and
# names are read while it lives; a short run is over within the tick) and any record with a stack.
URGENT_SOURCES = np.array([*catalog.GPU_API_SOURCES, catalog.CUDA_GRAPH])


def urgent(ev: np.ndarray) -> bool:
    """Whether any of the records ``ev`` is a traced process's (see URGENT_SOURCES): the drain hands
    them to the writer at once and does not rest, as it did before resting existed."""
    return bool(ev.size) and bool(np.isin(ev["source"], URGENT_SOURCES).any() or (ev["stack_id"] >= 0).any())


@dataclass(frozen=True)
class PipelineOptions:
    drain_interval_s: float = 0.05
    # A drain that found fewer than flush_events records doubles the wait before the next; past this the
    # drain rests (no timer: the housekeeping tick drains) and the RingWatch looks at the ring this
    # often; a busy drain brings it back to drain_interval_s. A burst from rest waits at most this
    # long: 300 k events/s fill 75 k of the 16 MiB ring's 262 k records (the tracer scales it down
    # with a smaller ring).
    idle_drain_interval_s: float = 0.25
    # Drained records that go to the writer at once (a busy drain); fewer wait for the housekeeping
    # tick (at most snapshot_interval_s). Names of processes that exec'd are read when drained.
    flush_events: int = 512
    channel_items: int = 256
    max_pending_events: int = 1 << 21  # ~128 MiB of records waiting for the writer, at most
    max_items_per_write: int = 64
    snapshot_interval_s: float = 1.0
    stats_interval_s: float = 5.0
    max_db_bytes: int = 0  # 0: no pruning
    prune_interval_s: float = 2.0


@dataclass
class _Item:
    kind: str  # events | kernel | snapshot | stats | prune
    events: np.ndarray | None = None
    offset_ns: int = 0
    rows: WriteBatch | None = None
    names: dict[int, str] | None = None  # events: names read when drained (Recorder.exec_names)


class Pipeline:
    def __init__(
        self,
        source: EventSource,
        writer: StoreWriter,
        recorder: Recorder,
        session_id: int,
        options: PipelineOptions | None = None,
        *,
        live: LiveStats | None = None,
        on_events: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.source = source
        self.writer = writer
        self.recorder = recorder
        self.session_id = session_id
        self.options = options or PipelineOptions()
        self.live = live
        self._on_events = on_events
        self._stop = trio.Event()
        self._sampler = SnapshotSampler()
        self.drained = 0
        self.drain_calls = 0
        self.drain_deferred = 0
        self.drain_cpu_s = 0.0
        self.writer_cpu_s = 0.0
        self.writes = 0
        self.pruned_rows = 0
        self.disk_full = 0  # write transactions refused with SQLITE_FULL
        self.pruned_disk_full = 0  # oldest events deleted to make room on a full disk
        self.lost_disk_full = 0  # events counted in aggregates but not stored: the disk was full
        self.max_drain = 0
        self._pending: list[np.ndarray] = []  # drained, not yet handed to the writer (take_pending)
        self._pending_n = 0
        self._pending_urgent = False  # a drained, pending record is urgent()
        self._pending_names: dict[int, str] = {}  # the drain's and the watch's look's (_names_lock)
        self._names_lock = threading.Lock()
        self._peeked = 0  # ring position up to which the watch looked
        self._watch: RingWatch | None = None  # while run() runs
        self._woken: trio.Event | None = None  # the resting drain's: set by the watch or request_stop
        self._kernel: dict[str, int] = {}
        self._exited: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._processed = 0  # events turned into rows (written by the writer thread only)
        self._side_rows: queue.SimpleQueue[WriteBatch] = queue.SimpleQueue()  # add_rows -> the next write
        self._side_closed = False
        self.started_ns = time.monotonic_ns()

    def forget_pids(self, pids: list[int]) -> None:
        """Processes that exited: the recorder drops their state at its next write (its thread)."""
        self._exited.put(list(pids))

    def request_stop(self) -> None:
        self._stop.set()
        if self._woken is not None:
            self._woken.set()

    def add_rows(self, rows: WriteBatch) -> bool:
        """Rows from outside the ring buffer (the annotation socket) for the writer's next batch (within
        a second: the housekeeping tick wakes it); False once the last batch was written."""
        if self._side_closed:
            return False
        self._side_rows.put(rows)
        return True

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> None:
        send, recv = trio.open_memory_channel[_Item](self.options.channel_items)
        opts = self.options
        self._watch = RingWatch(self.source.pending_records, opts.flush_events, opts.idle_drain_interval_s, self._look)
        self._watch.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer_loop, recv)
                nursery.start_soon(self._housekeeping_loop, send.clone())
                await self._drain_loop(send)
        finally:
            self._watch.stop()
        self._side_closed = True  # what add_rows took before this goes into one last write
        if not self._side_rows.empty():
            await trio.to_thread.run_sync(self._write_items, [])

    # --- drain -----------------------------------------------------------------------------------

    async def _drain_loop(self, send: trio.MemorySendChannel[_Item]) -> None:
        opts = self.options
        interval = opts.drain_interval_s
        async with send:
            while not self._stop.is_set():
                if interval > opts.idle_drain_interval_s:
                    await self._rest()
                else:
                    with trio.move_on_after(interval):
                        await self._stop.wait()
                if self._writer_behind(send):
                    self.drain_deferred += 1  # the records wait in the kernel ring
                    continue
                busy = self.drain_once() >= opts.flush_events
                interval = opts.drain_interval_s if busy else 2 * interval
                if self._pending_urgent:  # a traced process's: no rest, no wait for the tick
                    interval = min(interval, opts.idle_drain_interval_s)
                if (self._pending_n >= opts.flush_events or self._pending_urgent) and (
                    item := self.take_pending()
                ) is not None:
                    send.send_nowait(item)  # room checked above; the only other sender waits for room
            # Final reads: everything the kernel produced before the probes were detached.
            while self.drain_once():
                if self._pending_n >= opts.flush_events and (item := self.take_pending()) is not None:
                    await send.send(item)
            if (item := self.take_pending()) is not None:
                await send.send(item)

    async def _rest(self) -> None:
        """Until the ring holds ``flush_events`` records (the watch wakes us) or stop."""
        assert self._watch is not None
        self._woken = woken = trio.Event()
        if self._stop.is_set():
            return
        self._watch.arm(woken.set)
        try:
            await woken.wait()
        finally:
            self._watch.disarm()

    def _writer_behind(self, send: trio.MemorySendChannel[_Item]) -> bool:
        """The channel is full or too many drained records wait for the writer: leave them in the ring."""
        stats = send.statistics()
        return (
            stats.current_buffer_used >= stats.max_buffer_size
            or self.drained - self._processed >= self.options.max_pending_events
        )

    def drain_once(self) -> int:
        """One read of the ring buffer into the pending batch; the number of records read."""
        t0 = time.thread_time()
        ev = self.source.read_events()
        self.drain_calls += 1
        n = int(ev.size)
        if n:
            self.drained += n
            self.max_drain = max(self.max_drain, n)
            self._pending.append(ev)
            self._pending_n += n
            self._pending_urgent = self._pending_urgent or urgent(ev)
            self._add_names(self.recorder.exec_names(ev))
            self.recorder.prime_stacks(ev)
        self.drain_cpu_s += time.thread_time() - t0
        return n

    def _look(self) -> bool:
        """The watch's look at a resting ring (its thread, every idle_drain_interval_s): the names of the
        processes that exec'd since its last look, read now — as a drain as often would have; True (wake
        the drain) when an urgent() record waits."""
        ev, self._peeked = self.source.peek_events(self._peeked)
        if ev.size:
            self._add_names(self.recorder.exec_names(ev))
            self.recorder.prime_stacks(ev)
        return urgent(ev)

    def _add_names(self, names: dict[int, str]) -> None:
        """Names read while the processes lived (one that is gone reads empty: kept out)."""
        if names:
            with self._names_lock:
                self._pending_names.update((pid, name) for pid, name in names.items() if name)

    def take_pending(self) -> _Item | None:
        """The records drained since the last call as one channel item, after feeding them to the live
        statistics and ``on_events``; None when there are none."""
        if not self._pending:
            return None
        t0 = time.thread_time()
        ev = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        with self._names_lock:
            names, self._pending_names = self._pending_names, {}
        self._pending, self._pending_n, self._pending_urgent = [], 0, False
        if self.live is not None:
            self.live.add(ev)
        if self._on_events is not None:
            self._on_events(ev)
        self.drain_cpu_s += time.thread_time() - t0
        return _Item("events", events=ev, offset_ns=monotonic_offset_ns(), names=names)

    # --- housekeeping ----------------------------------------------------------------------------

    async def _housekeeping_loop(self, send: trio.MemorySendChannel[_Item]) -> None:
        opts = self.options
        next_stats = opts.stats_interval_s
        next_prune = opts.prune_interval_s
        elapsed = 0.0
        async with send:
            while not self._stop.is_set():
                with trio.move_on_after(opts.snapshot_interval_s):
                    await self._stop.wait()
                if self._stop.is_set():
                    break
                elapsed += opts.snapshot_interval_s
                extra = []
                if elapsed >= next_stats:
                    next_stats += opts.stats_interval_s
                    extra.append(_Item("stats"))
                if opts.max_db_bytes and elapsed >= next_prune:
                    next_prune += opts.prune_interval_s
                    extra.append(_Item("prune"))
                await self._tick(send, extra, events=True)
            await self._tick(send, [], events=False)  # the last page-allocation delta and counters

    async def _tick(self, send: trio.MemorySendChannel[_Item], extra: list[_Item], *, events: bool) -> None:
        """A snapshot, the page-allocation counters and (``events``) the pending records, handed over
        back to back: the writer takes them in one turn."""
        snap = self._sampler.sample()
        items = [_Item("snapshot", rows=WriteBatch(snapshots=[snap.as_row()])), _Item("kernel")]
        pending = None
        if events and not self._writer_behind(send):
            # the trickle a resting drain leaves (a busy one has just read); a burst the watch has not
            # woken the drain for (yet) wakes it here
            if self.drain_once() >= self.options.flush_events and self._woken is not None:
                self._woken.set()
            pending = self.take_pending()
        for item in ([pending] if pending is not None else []) + items + extra:
            try:
                send.send_nowait(item)  # no checkpoint between: the writer wakes once for all of them
            except trio.WouldBlock:
                await send.send(item)

    def _kernel_rows(self) -> WriteBatch:
        """The page allocations since the last tick from the kernel's counters, and the drop counters
        (the writer's thread reads them: no thread turn of their own, once a second)."""
        pages, self._kernel = self.source.page_allocs(), self.source.counters()
        if not pages:
            return WriteBatch()
        rows = self.recorder.page_alloc_rows(pages, now_ns())
        if self.live is not None:
            for r in rows.aggregates:
                self.live.add_counts(*PAGE_ALLOC, int(r[4]))
        return rows

    # --- writer ----------------------------------------------------------------------------------

    async def _writer_loop(self, recv: trio.MemoryReceiveChannel[_Item]) -> None:
        async with recv:
            async for item in recv:
                items = [item]
                while len(items) < self.options.max_items_per_write:
                    try:
                        items.append(recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await trio.to_thread.run_sync(self._write_items, items)

    def _write_items(self, items: list[_Item]) -> None:
        t0 = time.thread_time()
        batch = WriteBatch()
        stats = prune = False
        while not self._side_rows.empty():
            batch.merge(self._side_rows.get_nowait())
        for it in items:
            if it.kind == "events" and it.events is not None:
                batch.merge(self.recorder.process(it.events, it.offset_ns, it.names))
                self._processed += it.events.size
            elif it.kind == "kernel":
                batch.merge(self._kernel_rows())
            elif it.rows is not None:
                batch.merge(it.rows)
            stats |= it.kind == "stats"
            prune |= it.kind == "prune"
        self._write(batch)
        self.writes += 1
        while not self._exited.empty():
            self.recorder.forget_pids(self._exited.get_nowait())
        try:
            if stats:
                self.writer.save_stats(self.session_id, self.stats())
            if prune and self.options.max_db_bytes:
                self.pruned_rows += self.writer.prune_oldest(self.options.max_db_bytes)
        except DiskFullError:
            self.pruned_disk_full += self.writer.make_room()  # the next batch gets the room
        self.writer_cpu_s += time.thread_time() - t0

    def _write(self, batch: WriteBatch) -> None:
        """The batch in transactions of at most ``writer.rows_per_transaction()`` events (the first
        one carries everything else). On a full disk: prune the oldest events and go on from the
        first transaction that failed; on the last try write no more event rows (the aggregates
        still count them). DiskFullError only when even that does not fit: recording cannot go on."""
        events = batch.events
        done = 0  # events written; the rest of the batch goes with the first transaction
        dropped: list[tuple[int, ...]] = []  # counted as stored in the aggregates, but never written
        for attempt in range(DISK_FULL_ATTEMPTS):
            try:
                step = self.writer.rows_per_transaction()
                while done == 0 or done < len(events):
                    chunk = events[done : done + step]
                    if done == 0:
                        self.writer.write_batch(
                            chunk,  # type: ignore[arg-type]  # rows of 12 ints in EVENT_FIELDS order
                            stacks=batch.stacks,
                            aggregates=batch.aggregates,
                            snapshots=batch.snapshots,
                            process_names=batch.process_names,
                            nccl_comms=batch.nccl_comms,
                            nccl_calls=batch.nccl_calls,
                            annotations=batch.annotations,
                            engine_metrics=batch.engine_metrics,
                            cgroups=batch.cgroups,
                        )
                        done = max(1, len(chunk)) if events else 1
                    else:
                        self.writer.write_batch(chunk)  # type: ignore[arg-type]
                        done += len(chunk)
                if dropped:
                    self.writer.unstore(dropped)
                return
            except DiskFullError:
                self.disk_full += 1
                freed = self.writer.make_room()
                self.pruned_disk_full += freed
                if attempt == DISK_FULL_ATTEMPTS - 1:
                    raise
                if not freed or attempt == DISK_FULL_ATTEMPTS - 2:
                    # last try: no more event rows (still counted in the aggregates)
                    self.lost_disk_full += len(events) - min(done, len(events))
                    dropped += events[done:]
                    events = events[:done] if done else []

    # --- numbers ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        rec = self.recorder
        out = {
            "events_seen": rec.seen,
            "events_stored": rec.stored - self.lost_disk_full,  # rows the disk had no room for were not stored
            "events_aggregated_only": rec.seen - rec.stored,
            "events_drained": self.drained,
            "drain_calls": self.drain_calls,
            "drain_deferred": self.drain_deferred,
            "max_events_per_drain": self.max_drain,
            "write_transactions": self.writes,
            "rows_pruned": self.pruned_rows,
            "disk_full_errors": self.disk_full,
            "rows_pruned_disk_full": self.pruned_disk_full + self.writer.pruned_when_full,
            "events_lost_disk_full": self.lost_disk_full,
            "drain_cpu_us": int(self.drain_cpu_s * 1e6),
            "writer_cpu_us": int(self.writer_cpu_s * 1e6),
            "nccl_comm_records": rec.control_records,
        }
        out.update(self._kernel)
        return out

    async def refresh_kernel_counters(self) -> None:
        self._kernel = await trio.to_thread.run_sync(self.source.counters)

    def kernel_counters(self) -> dict[str, Any]:
        return dict(self._kernel)
