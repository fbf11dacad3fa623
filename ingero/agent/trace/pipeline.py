"""The recording pipeline: drain on a timer -> bounded channel -> the store's single writer.

* **drain** (trio task, every ``drain_interval_s``): reads every record the ring buffer holds
  (:class:`~ingero.agent.trace.ringbuf.RingReader`, a memory copy — ~0.1 µs per event), feeds the live
  statistics and sends the array down a bounded trio memory channel. When the channel is full the
  drain skips its turn and the records wait in the kernel ring buffer (16 MiB by default); if that
  overflows too, the kernel counts the loss (``events_dropped_ring``). Nothing is dropped silently.
* **housekeeping** (every second): a system snapshot, the kernel's page-allocation counters, the
  kernel drop counters; session stats every few seconds; size-based pruning with ``--max-db``.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from ingero.agent.trace.livestats import LiveStats
from ingero.agent.trace.recorder import PAGE_ALLOC, Recorder, WriteBatch, monotonic_offset_ns
from ingero.agent.trace.sysinfo import SnapshotSampler
from ingero.errors import DiskFullError
from ingero.store.writer import StoreWriter

DISK_FULL_ATTEMPTS = 3  # full batch, full batch after pruning, aggregates only after pruning more


class EventSource(Protocol):
    """What the pipeline needs from the probes (:class:`~ingero.agent.trace.probes.BpfProbes`)."""

    def read_events(self) -> np.ndarray: ...

    def counters(self) -> dict[str, int]: ...

    def page_allocs(self) -> dict[int, tuple[int, int]]: ...


@dataclass(frozen=True)
class PipelineOptions:
    drain_interval_s: float = 0.05
    # A drain that found nothing doubles the wait before the next, up to this (an idle host: 4 wakeups
    # a second, not 20); any event brings it back to drain_interval_s (names of short-lived processes
    # are read while they live). A burst from rest waits at most this long: 300 k events/s fill 75 k
    # of the 16 MiB ring's 262 k records (the tracer scales it down with a smaller ring).
    idle_drain_interval_s: float = 0.25
    channel_items: int = 256
    max_pending_events: int = 1 << 21  # ~128 MiB of records waiting for the writer, at most
    max_items_per_write: int = 64
    snapshot_interval_s: float = 1.0
    stats_interval_s: float = 5.0
    max_db_bytes: int = 0  # 0: no pruning
    prune_interval_s: float = 2.0


@dataclass
class _Item:
    kind: str  # events | pages | snapshot | stats | prune
    events: np.ndarray | None = None
    offset_ns: int = 0
    pages: dict[int, tuple[int, int]] | None = None
    ts: int = 0
    rows: WriteBatch | None = None


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
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer_loop, recv)
            nursery.start_soon(self._housekeeping_loop, send.clone())
            await self._drain_loop(send)
        self._side_closed = True  # what add_rows took before this goes into one last write
        if not self._side_rows.empty():
            await trio.to_thread.run_sync(self._write_items, [])

    # --- drain -----------------------------------------------------------------------------------

    async def _drain_loop(self, send: trio.MemorySendChannel[_Item]) -> None:
        opts = self.options
        interval = opts.drain_interval_s
        async with send:
            while not self._stop.is_set():
                with trio.move_on_after(interval):
                    await self._stop.wait()
                stats = send.statistics()
                if (
                    stats.current_buffer_used >= stats.max_buffer_size
                    or self.drained - self._processed >= self.options.max_pending_events
                ):
                    self.drain_deferred += 1  # the writer is behind: the records wait in the kernel ring
                    continue
                item = self.drain_once()
                interval = opts.drain_interval_s if item is not None else min(2 * interval, opts.idle_drain_interval_s)
                if item is not None:
                    send.send_nowait(item)  # room checked above; this task is the only sender of events
            # Final reads: everything the kernel produced before the probes were detached.
            while (item := self.drain_once()) is not None:
                await send.send(item)

    def drain_once(self) -> _Item | None:
        """One read of the ring buffer; the channel item for it, or None when it was empty."""
        t0 = time.thread_time()
        ev = self.source.read_events()
        self.drain_calls += 1
        n = int(ev.size)
        if n:
            self.drained += n
            self.max_drain = max(self.max_drain, n)
            if self.live is not None:
                self.live.add(ev)
            if self._on_events is not None:
                self._on_events(ev)
        self.drain_cpu_s += time.thread_time() - t0
        if not n:
            return None
        return _Item("events", events=ev, offset_ns=monotonic_offset_ns())

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
                await self._tick(send)
                if elapsed >= next_stats:
                    next_stats += opts.stats_interval_s
                    await send.send(_Item("stats"))
                if opts.max_db_bytes and elapsed >= next_prune:
                    next_prune += opts.prune_interval_s
                    await send.send(_Item("prune"))
            await self._tick(send)  # the last page-allocation delta and counters

    async def _tick(self, send: trio.MemorySendChannel[_Item]) -> None:
        snap = self._sampler.sample()
        await send.send(_Item("snapshot", rows=WriteBatch(snapshots=[snap.as_row()])))
        pages, self._kernel = await trio.to_thread.run_sync(self._kernel_maps)
        if pages:
            await send.send(_Item("pages", pages=pages, ts=snap.timestamp))

    def _kernel_maps(self) -> tuple[dict[int, tuple[int, int]], dict[str, int]]:
        """The kernel's page-allocation counters and drop counters: one worker-thread turn a second."""
        return self.source.page_allocs(), self.source.counters()

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
                batch.merge(self.recorder.process(it.events, it.offset_ns))
                self._processed += it.events.size
            elif it.kind == "pages" and it.pages is not None:
                rows = self.recorder.page_alloc_rows(it.pages, it.ts)
                if self.live is not None:
                    for r in rows.aggregates:
                        self.live.add_counts(*PAGE_ALLOC, int(r[4]))
                batch.merge(rows)
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
