"""One ``ingero trace`` run: discovery, probes, pipeline, live view, optional API server, shutdown.

:func:`run_trace` is async (trio). It reports readiness with ``task_status.started(TraceReady)``
once every probe is attached, so tests (and ``--ready-file``) start workloads only then. It stops on
``--duration``, SIGINT/SIGTERM (a second one stops without waiting for the writer) or
:meth:`TraceControl.stop`, and always — error or not — silences the BPF programs (a flag they check:
instant), drains what the kernel already produced, closes the ``sessions`` row with its counters
(``session_stats``), closes the database, hands the summary to the view (the CLI prints it) and only
then detaches the probes (the kernel takes ~0.1 s per uprobe to unregister one). The tracer never
prints: progress goes to a :class:`~ingero.agent.trace.livemode.LiveView` given by the caller.

Within a run, a server given by the caller (``--listen``: the CLI hands in the agent API,
:func:`ingero.agent.api.server.serve_api`; the tracer does not import the API) runs in the same trio nursery; a maintenance task probes libraries that new processes map (follow mode, every 2 s) and
forgets what is kept per process (kernel page-allocation counters, recorder state) once it exited.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import trio

from ingero.agent.trace import discovery
from ingero.agent.trace.cgroups import CgroupTracker
from ingero.agent.trace.livemode import LiveView, tick_loop
from ingero.agent.trace.livestats import LiveStats
from ingero.agent.trace.pipeline import Pipeline, PipelineOptions
from ingero.agent.trace.pyframes import PyFrames
from ingero.agent.trace.recorder import Recorder, StoragePolicy, WriteBatch
from ingero.agent.trace.stacks import Symbolizer
from ingero.agent.trace.sysinfo import session_info
from ingero.errors import DiskFullError, IngeroError, UsageError
from ingero.identity import Identity
from ingero.store import catalog

if TYPE_CHECKING:
    from ingero.agent.trace.probes import BpfProbes, LibraryAttach
    from ingero.store.writer import StoreWriter

RESCAN_INTERVAL_S = 2.0
_FORK, _EXIT = catalog.lookup_op("process_fork"), catalog.lookup_op("process_exit")


@dataclass
class TraceOptions:
    db_path: Path
    identity: Identity
    pids: list[int] = field(default_factory=list)
    uids: list[int] = field(default_factory=list)  # --user: later processes of these uids are enrolled too
    overrides: dict[str, list[str]] = field(default_factory=dict)
    duration_s: float | None = None
    stack_mode: str = "site"
    store_mode: str = "selective"
    budget_per_s: int = 1000
    stack_samples: int = 0  # distinct stacks kept per (pid, op); 0 = no limit
    python_frames: bool = True  # [Python] file:line frames in stored stacks of CPython 3.10–3.12 threads
    max_db_bytes: int = 0
    ring_mb: int = 16
    host: bool = True
    io: bool = True
    socket_rw: bool = False  # --socket-rw: read/write on sockets recorded too (net_send / net_recv)
    follow: bool = True
    system_search: bool = True  # ldconfig, CUDA installs, pip bundles (off: overrides + processes only)
    drain_interval_s: float = 0.05
    output: str = "table"  # table | json | quiet
    # A server to run beside the recording (``--listen``): started with ``nursery.start``, it reports
    # readiness with ``task_status.started(value)``; ``value`` becomes ``TraceReady.server``.
    serve: Callable[..., Awaitable[Any]] | None = None
    flags: str = ""
    observer: TraceObserver | None = None  # e.g. ingero.metrics (--prometheus / --otlp)
    annotate: bool = False  # --annotate: the annotation socket (ingero.agent.trace.annotate_socket)
    annotate_gid: int | None = None  # --annotate-socket-gid: one group may connect too
    inference: bool = False  # --inference: serving engines' metrics (ingero.agent.trace.engine_scrape)


class TraceObserver(Protocol):
    """Sees every drained event batch (before selective storage) and the running pipeline."""

    def attach(self, pipeline: Pipeline) -> None: ...

    def on_events(self, ev: np.ndarray) -> None: ...


@dataclass
class TraceReady:
    session_id: int
    libraries: list[LibraryAttach]
    probes: int
    server: Any  # what ``TraceOptions.serve`` reported when started (the CLI's BoundServer); None without one
    control: TraceControl
    annotate_socket: Path | None = None  # where --annotate listens
    socket_pids: Callable[[], set[int]] = set  # the processes whose socket calls are probed now


@dataclass
class TraceSummary:
    session_id: int
    db_path: Path
    elapsed_s: float
    stats: dict[str, int]
    ops: list[dict[str, Any]]
    libraries: list[dict[str, Any]]
    reason: str


class TraceControl:
    """Handle for a running trace: stop it, or ask for a library rescan now, from another task."""

    def __init__(self) -> None:
        self._stop = trio.Event()
        self.reason = ""
        self._rescan_request = trio.Event()
        self._rescan_done = trio.Event()

    async def rescan(self) -> None:
        """Look for new GPU libraries in running processes now (follow mode does so every 2 s)."""
        done = self._rescan_done
        self._rescan_request.set()
        await done.wait()

    async def _next_rescan(self, interval: float) -> None:
        with trio.move_on_after(interval):
            await self._rescan_request.wait()

    def _rescanned(self) -> None:
        self._rescan_request = trio.Event()
        done, self._rescan_done = self._rescan_done, trio.Event()
        done.set()

    def stop(self, reason: str = "stopped") -> None:
        if not self._stop.is_set():
            self.reason = reason
            self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()


def _session_flags(opts: TraceOptions) -> str:
    parts = [f"stack={opts.stack_mode}", f"store={opts.store_mode}", "record"]
    if opts.max_db_bytes:
        parts.append(f"max-db={opts.max_db_bytes}")
    if opts.uids:
        parts.append("users=" + "+".join(str(u) for u in opts.uids))
    if opts.stack_samples:
        parts.append(f"stack-samples={opts.stack_samples}")
    if opts.serve is not None:
        parts.append("listen")
    if opts.flags:
        parts.append(opts.flags)
    return ",".join(parts)


def _cuda_version(libs: list[discovery.LibraryFile]) -> str:
    for lib in libs:
        if lib.kind == "cudart" and lib.version:
            return lib.version
    return ""


class _Follower:
    """Keeps the probes on every GPU library: new processes, new library files (follow mode)."""

    def __init__(self, probes: BpfProbes, opts: TraceOptions, sizes: dict[int, str] | None = None) -> None:
        self.probes = probes
        self.opts = opts
        self.targets: set[int] = set(opts.pids)
        self.exited: list[int] = []
        self.cgroups = CgroupTracker()  # cgroup id -> container / pod / Slurm job (cgroup_metadata)
        self.side_rows: Callable[[WriteBatch], bool] | None = None  # the pipeline's add_rows, once it runs
        self.pyframes: PyFrames | None = None
        self.py_noted: set[int] = set()
        # pid -> its address-space size at the last rescan (given: as before the start-up discovery,
        # which read every process's maps; only processes changed since are read again)
        self._sizes: dict[int, str] = sizes or {}

    def on_events(self, ev: np.ndarray) -> None:
        self.cgroups.on_events(ev)
        host = ev[ev["source"] == _FORK.source]
        if host.size == 0:
            return
        forks = host[host["op"] == _FORK.op]
        if forks.size:
            self.targets.update(int(x) for x in forks["arg1"])
        exits = host[host["op"] == _EXIT.op]
        if exits.size:
            self.exited.extend(int(x) for x in exits["pid"])

    def sync_sockets(self) -> None:
        """Socket-call uprobes on every traced process and on no other: attach for new targets, detach
        for gone ones (net_probes.c). A process the kernel enrols (its first GPU call, a fork) has
        its socket calls recorded from this sync on (RESCAN_INTERVAL_S, or TraceControl.rescan)."""
        if not self.probes.options.socket_uprobes:
            return
        now, had = self.probes.target_pids(), self.probes.socket_pids()
        for pid in sorted(now - had):
            self.probes.attach_sockets(pid)
        if had - now:
            self.probes.detach_sockets(sorted(had - now))

    def attach(self, libs: list[discovery.LibraryFile]) -> list[LibraryAttach]:
        return [self.probes.attach_library(lib.kind, lib.path) for lib in libs]

    def rescan(self) -> list[LibraryAttach]:
        """Probe the GPU libraries of processes whose mappings may have changed since the last rescan."""
        candidates = sorted(self.targets) if self.opts.pids else discovery.all_pids()
        changed = self.changed(candidates)
        if not changed:
            return []
        found = discovery.discover(self.opts.overrides, pids=changed, system=False)
        fresh = [lib for lib in found.libraries if lib.origin != "override"]
        return [r for r in self.attach(fresh) if r.probes]

    def changed(self, pids: list[int]) -> list[int]:
        """The processes that are new, or whose address-space size changed (/proc/<pid>/statm: a dlopen
        maps new segments), since the last call: only their maps are read again. An idle host's
        rescan is one small read per process instead of every process's whole maps."""
        sizes = address_space_sizes(pids, self._sizes)
        out = [pid for pid, size in sizes.items() if self._sizes.get(pid) != size]
        self._sizes = sizes
        return out

    def maintain(self) -> list[LibraryAttach]:
        """One maintenance turn in a worker thread: new libraries (follow mode), socket probes on the
        traced processes, cgroup names resolved and written. Returns the newly probed libraries."""
        new = self.rescan() if self.opts.follow else []
        self.sync_sockets()
        rows = self.cgroups.rows()
        if rows and self.side_rows is not None:
            self.side_rows(WriteBatch(cgroups=list(rows)))  # the writer's next batch
        return new


def address_space_sizes(pids: list[int], known: dict[int, str] | None = None) -> dict[int, str]:
    """pid -> the first field of /proc/<pid>/statm (address-space size in pages) of the live ones,
    read with bare syscalls (one per process every RESCAN_INTERVAL_S). A kernel thread ("0" in
    ``known``) stays one: not read again."""
    out: dict[int, str] = {}
    for pid in pids:
        size = (known or {}).get(pid)
        if size != "0":
            try:
                fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.read(fd, 32).split(b" ", 1)[0].decode()
            except OSError:
                continue
            finally:
                os.close(fd)
        if size is not None:
            out[pid] = size
    return out


async def run_trace(
    opts: TraceOptions,
    *,
    view: LiveView | None = None,
    task_status: trio.TaskStatus[TraceReady] = trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
) -> TraceSummary:
    """Record until stopped; readiness (every probe attached) through ``task_status``, progress to
    ``view`` (the CLI's live table / JSON lines; None: silent). Returns the summary."""
    from ingero.agent.trace.probes import BpfProbes, ProbeOptions, preflight
    from ingero.store.writer import StoreWriter

    preflight()
    problems = discovery.validate_overrides(opts.overrides)
    if problems:
        raise UsageError(problems[0], hint="give the path of the library file")
    for pid in opts.pids:
        if not discovery.pid_alive(pid):
            raise UsageError(f"--pid {pid}: no such process")
    # The processes' address-space sizes first: one that changes during the discovery is read again.
    sizes, found = await trio.to_thread.run_sync(
        lambda: (
            address_space_sizes(discovery.all_pids()) if opts.follow else {},
            discovery.discover(opts.overrides, pids=opts.pids or None, system=opts.system_search),
        )
    )
    probe_opts = ProbeOptions(
        pid_filter=bool(opts.pids or opts.uids),
        stack_mode=opts.stack_mode,
        ring_mb=opts.ring_mb,
        host=opts.host,
        io=opts.io,
        socket_rw=opts.socket_rw,
    )
    # The database first: a second tracer on it fails at once (the writer lock), before any compiling.
    writer = StoreWriter(opts.db_path, opts.identity)
    try:
        probes: BpfProbes = await trio.to_thread.run_sync(BpfProbes, probe_opts)
    except BaseException:
        writer.close()
        raise
    session_id = 0
    pipeline: Pipeline | None = None
    attached: list[LibraryAttach] = []
    live = LiveStats()
    control = TraceControl()
    t0 = time.monotonic()
    try:
        info = session_info(
            cuda_version=_cuda_version(found.libraries),
            pid_filter=",".join(str(p) for p in opts.pids),
            flags=_session_flags(opts),
        )
        session_id = writer.start_session(info)
        if opts.pids:
            probes.add_targets(opts.pids)
        if opts.uids:
            probes.add_target_uids(opts.uids)
        follower = _Follower(probes, opts, sizes)
        attached = await trio.to_thread.run_sync(follower.attach, found.libraries)
        await trio.to_thread.run_sync(follower.sync_sockets)
        follower.pyframes = PyFrames() if opts.python_frames and opts.stack_mode != "off" else None
        recorder = Recorder(
            StoragePolicy(opts.store_mode, opts.budget_per_s, opts.stack_samples),
            probes.stack_ips,
            symbolizer=Symbolizer(python=follower.pyframes),
        )
        pipeline = Pipeline(
            probes,
            writer,
            recorder,
            session_id,
            PipelineOptions(
                drain_interval_s=opts.drain_interval_s,
                idle_drain_interval_s=_idle_drain_interval(opts),
                max_db_bytes=opts.max_db_bytes,
            ),
            live=live,
            on_events=follower.on_events if opts.observer is None else _both(follower.on_events, opts.observer),
        )
        follower.side_rows = pipeline.add_rows  # cgroup rows go through the one writer's batches
        if opts.observer is not None:
            opts.observer.attach(pipeline)
        async with trio.open_nursery() as nursery:
            bound = None
            if opts.serve is not None:
                bound = await nursery.start(opts.serve)
            annotate = await nursery.start(_annotate_server, opts, pipeline) if opts.annotate else None
            pipeline_done = trio.Event()
            nursery.start_soon(_run_pipeline, pipeline, pipeline_done)
            if handle_signals:
                nursery.start_soon(_watch_signals, control)
            if opts.duration_s is not None:
                nursery.start_soon(_stop_after, control, opts.duration_s)
            nursery.start_soon(_maintenance_loop, follower, probes, pipeline, view, control)
            if opts.inference:
                nursery.start_soon(_inference_loop, pipeline)
            if view is not None:
                nursery.start_soon(tick_loop, view, live, pipeline)
            ready = TraceReady(
                session_id, attached, len(probes.attached_probes()), bound, control, annotate, probes.socket_pids
            )
            task_status.started(ready)  # the one readiness report (the caller announces it)
            await control.wait()
            # Shutdown: the programs stop emitting (a flag, instant), a last drain, the writer commits,
            # then the server goes. Detaching the probes is slow (~0.1 s each): it comes last.
            probes.stop_events()
            pipeline.request_stop()
            with trio.CancelScope(shield=True):
                await pipeline_done.wait()
                last = await trio.to_thread.run_sync(follower.cgroups.rows)
                if last:  # resolved after the last batch: the same writer, now idle, takes them
                    await trio.to_thread.run_sync(functools.partial(writer.write_batch, cgroups=last))
            nursery.cancel_scope.cancel()
    except BaseException as e:
        with trio.CancelScope(shield=True):
            elapsed, stats = await _close(writer, session_id, pipeline, probes, t0)
            await trio.to_thread.run_sync(probes.close)
        cause = _recording_error(e)
        if view is not None and pipeline is not None and cause is not None:
            # recording could not go on (a disk with no room even for the aggregates, ...): what was
            # recorded until then is still summed up, then the one-line error follows
            view.finished(_summary(opts, session_id, elapsed, stats, live, attached, f"stopped ({cause.message})"))
        raise
    elapsed, stats = await _close(writer, session_id, pipeline, probes, t0)
    summary = _summary(opts, session_id, elapsed, stats, live, attached, control.reason or "stopped")
    if view is not None:
        view.finished(summary)
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(probes.close)
    return summary


def _summary(
    opts: TraceOptions,
    session_id: int,
    elapsed: float,
    stats: dict[str, int],
    live: LiveStats,
    attached: list[LibraryAttach],
    reason: str,
) -> TraceSummary:
    return TraceSummary(
        session_id=session_id,
        db_path=opts.db_path,
        elapsed_s=elapsed,
        stats=stats,
        ops=[line.as_dict() for line in live.snapshot(max(elapsed, 1e-9))],
        libraries=[{"kind": a.kind, "path": a.path, "functions": [p.symbol for p in a.probes]} for a in attached],
        reason=reason,
    )


def _recording_error(e: BaseException) -> IngeroError | None:
    """The ingero error that ended a recording (alone, or the one error of trio's group), else None."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e if isinstance(e, IngeroError) else None


async def _close(
    writer: StoreWriter | None, session_id: int, pipeline: Pipeline | None, probes: BpfProbes, t0: float
) -> tuple[float, dict[str, int]]:
    """Close the session (with its counters) and the database. Never raises for a second time."""
    elapsed = time.monotonic() - t0
    probes.stop_events()
    stats: dict[str, int] = {}
    if pipeline is not None:
        with trio.CancelScope(shield=True):
            await pipeline.refresh_kernel_counters()
        stats = pipeline.stats()
        stats["probes_attached"] = len(probes.attached_probes())
        if pipeline.recorder.stacks_over_limit:
            stats["stacks_over_limit"] = pipeline.recorder.stacks_over_limit
        stats["elapsed_ms"] = int(elapsed * 1000)
    if writer is not None:
        try:
            if session_id:
                try:
                    writer.end_session(session_id, stats)
                except DiskFullError:  # make room (the oldest events) for the session's counters
                    stats["rows_pruned_disk_full"] = stats.get("rows_pruned_disk_full", 0) + writer.make_room()
                    writer.end_session(session_id, stats)
        finally:
            writer.close()
    return elapsed, stats


def _idle_drain_interval(opts: TraceOptions) -> float:
    """How long a burst from rest may wait for the drain (the ring watch's interval): PipelineOptions' idle
    interval with the default 16 MiB ring (a burst from rest at 300 k events/s fills under a third of it),
    less with a smaller ring, never under the busy interval."""
    default = PipelineOptions()
    scaled = default.idle_drain_interval_s * opts.ring_mb / TraceOptions.ring_mb
    return max(opts.drain_interval_s, min(default.idle_drain_interval_s, scaled))


def _both(first: Callable[[np.ndarray], None], observer: TraceObserver) -> Callable[[np.ndarray], None]:
    def on_events(ev: np.ndarray) -> None:
        first(ev)
        observer.on_events(ev)

    return on_events


async def _annotate_server(
    opts: TraceOptions, pipeline: Pipeline, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    """--annotate: labels from the socket go into the pipeline's next write (its single writer)."""
    from ingero.agent.trace.annotate_socket import serve_annotations

    def sink(rows: list[Any]) -> bool:
        return pipeline.add_rows(WriteBatch(annotations=rows))

    await serve_annotations(sink, gid=opts.annotate_gid, task_status=task_status)


async def _inference_loop(pipeline: Pipeline) -> None:
    """--inference: the engines' metrics go into the pipeline's next write (its single writer)."""
    from ingero.agent.trace.engine_scrape import Scraper

    await Scraper(lambda rows: pipeline.add_rows(WriteBatch(engine_metrics=list(rows)))).run()


async def _run_pipeline(pipeline: Pipeline, done: trio.Event) -> None:
    try:
        await pipeline.run()
    finally:
        done.set()


async def _watch_signals(control: TraceControl) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if control.stopping:
                raise IngeroError(f"{name} again: stopping without waiting for the writer")
            control.stop(name)


async def _stop_after(control: TraceControl, seconds: float) -> None:
    await trio.sleep(seconds)
    control.stop("duration reached")


async def _maintenance_loop(
    follower: _Follower, probes: BpfProbes, pipeline: Pipeline, view: LiveView | None, control: TraceControl
) -> None:
    """Every RESCAN_INTERVAL_S (or on request): probe new GPU libraries (follow mode), keep the
    socket-call uprobes on the traced processes, and drop what is kept per process (kernel
    page-allocation counters, the recorder's state) once it exited."""
    while True:
        await control._next_rescan(RESCAN_INTERVAL_S)
        new = await trio.to_thread.run_sync(follower.maintain)
        for lib in new:
            if view is not None:
                view.note(f"probing {lib.kind} {lib.path} ({len(lib.probes)} functions)")
        if follower.pyframes is not None and view is not None:
            for pid, problem in list(follower.pyframes.problems.items()):
                if pid not in follower.py_noted:
                    follower.py_noted.add(pid)
                    view.note(f"pid {pid}: no Python frames in its stacks: {problem}")
        if follower.exited:
            gone, follower.exited = follower.exited, []
            await trio.to_thread.run_sync(probes.forget_page_allocs, gone)
            pipeline.forget_pids(gone)
        control._rescanned()


def parse_size(text: str) -> int:
    """``10g``, ``500MB``, ``1t``, ``4096`` -> bytes (powers of 1024). Raises UsageError."""
    t = text.strip().lower().removesuffix("b")
    mult = 1
    if t and t[-1] in "kmgt":
        mult = 1024 ** ("kmgt".index(t[-1]) + 1)
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise UsageError(f"cannot parse size {text!r}", hint="use e.g. 500m, 10g") from None
    if value <= 0 or math.isinf(value) or math.isnan(value):
        raise UsageError(f"size must be positive: {text!r}")
    return int(value * mult)
