"""``ingero trace``: record CUDA / driver / NCCL calls and host events into the node's database."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ingero.cli import common, metrics_flags, serve
from ingero.cli.clickhouse import add_clickhouse_arg

if TYPE_CHECKING:
    from ingero.agent.trace.tracer import TraceOptions, TraceReady

EXAMPLES = """\
examples:
  sudo ingero trace --db trace.db                          record until Ctrl-C, live per-op table
  sudo ingero trace --db trace.db --duration 60s --json    JSON lines: start, one tick per second, summary
  sudo ingero trace --db trace.db -p 4242,4243             only these processes (and their children)
  sudo ingero trace --db trace.db --user alice --duration 1h30m   alice's processes for 90 minutes
  sudo ingero trace --db trace.db --record-all --stack-samples 64   every event, <= 64 stacks per op
  sudo ingero trace --db trace.db --listen 0.0.0.0:8443 --client-ca ~/.ingero/pki/ca.pem \\
      --tls-cert ~/.ingero/pki/node-gpu-node-01.pem --tls-key ~/.ingero/pki/node-gpu-node-01-key.pem
                                                           record and serve the agent API (mTLS)
  sudo ingero trace --db trace.db --cuda-lib /opt/app/lib/libcudart.so.12 --nccl-lib /opt/nccl/lib/libnccl.so.2
  sudo ingero trace --db trace.db --store all --stack full --max-db 2g
  sudo ingero trace --db trace.db --socket-rw              socket read/write too (a data loader over HTTPS)
  sudo ingero trace --db trace.db --prometheus :9464 --otlp http://otelcol:4318
                                                           export metrics (Prometheus scrape, OTLP push)

What is traced: uprobes on libcudart (cudaMalloc, cudaFree, cudaLaunchKernel, cudaMemcpy[Async],
cudaStreamSynchronize, cudaDeviceSynchronize, cudaMallocManaged), libcuda (cuLaunchKernel, cuMemcpy*,
cuCtxSynchronize, cuMemAlloc_v2, cuMemAllocManaged) and libnccl (collectives, send/recv, communicator
ranks), plus sched_switch/sched_wakeup, process exec/exit/fork and page allocations of the traced
processes, block I/O and TCP retransmissions of the host, and OOM kills. Libraries are found in running
processes, ldconfig, CUDA installs and pip wheels (nvidia/*/lib); new processes are followed.
Selective storage keeps every event explain needs and samples high-rate ones (--store all keeps all);
event_aggregates counts everything. Needs root (or CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN) and bcc:
'ingero check' tells what is missing. SIGINT/SIGTERM stop cleanly: probes detached, buffers flushed,
the session closed with its counters (table session_stats).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        parents=parents,
        help="record CUDA/NCCL calls and host events with eBPF (root)",
        description="Record CUDA runtime/driver and NCCL calls (eBPF uprobes) and host events "
        "(scheduler, process lifecycle, memory, block I/O, TCP) into this node's SQLite database, "
        "with a live per-op view; optionally serve the agent API at the same time.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p)
    common.add_node_arg(p)
    p.add_argument("--duration", metavar="DUR", help="stop after DUR (30s, 5m, 1h); default: until Ctrl-C")
    p.add_argument(
        "-p",
        "--pid",
        action="append",
        default=[],
        metavar="PID[,PID...]",
        help="trace only these processes and their children (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="USER",
        help="trace only the processes of this user (name or uid; repeatable), and their children",
    )
    p.add_argument(
        "--no-follow",
        dest="follow",
        action="store_false",
        help="do not rescan /proc every 2s for new GPU libraries (new processes of known libraries are always seen)",
    )
    out = p.add_argument_group("output")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument("--json", dest="output", action="store_const", const="json", help="JSON lines on stdout")
    fmt.add_argument("--quiet", dest="output", action="store_const", const="quiet", help="only the final summary")
    p.set_defaults(output="table")
    libs = p.add_argument_group("libraries (each replaces discovery for its kind; repeatable)")
    libs.add_argument("--cuda-lib", action="append", default=[], metavar="PATH", help="a libcudart.so to probe")
    libs.add_argument("--driver-lib", action="append", default=[], metavar="PATH", help="a libcuda.so to probe")
    libs.add_argument("--nccl-lib", action="append", default=[], metavar="PATH", help="a libnccl.so to probe")
    libs.add_argument(
        "--no-system-search",
        dest="system_search",
        action="store_false",
        help="skip ldconfig, CUDA install trees and pip wheels (overrides and running processes only)",
    )
    rec = p.add_argument_group("recording")
    rec.add_argument(
        "--stack",
        choices=("site", "full", "off"),
        default="site",
        help="user stacks: site = walked once per call site and reused (default), full = every call, off",
    )
    rec.add_argument("--no-stack", dest="stack", action="store_const", const="off", help="same as --stack off")
    rec.add_argument(
        "--no-python-frames",
        dest="python_frames",
        action="store_false",
        help="no [Python] file:line frames in stored stacks (read from CPython 3.10–3.12 processes' memory)",
    )
    rec.add_argument(
        "--store",
        choices=("selective", "all"),
        default="selective",
        help="selective (default): every explain-relevant event, a sample of high-rate ones; all: everything",
    )
    rec.add_argument(
        "--record-all",
        dest="store",
        action="store_const",
        const="all",
        help="store every event (same as --store all); default: selective storage",
    )
    rec.add_argument(
        "--stack-samples",
        type=int,
        default=0,
        metavar="N",
        help="keep at most N distinct stacks per process and op (0 = no limit, default); calls from "
        "further call sites are stored without a stack (counted in session_stats as stacks_over_limit)",
    )
    rec.add_argument(
        "--sample-budget",
        type=int,
        default=1000,
        metavar="N",
        help="high-rate ops stored per second per process (1000)",
    )
    rec.add_argument(
        "--max-db",
        metavar="SIZE",
        default="10g",
        help="database rollover: beyond SIZE the oldest events are pruned, the newest kept (10g; 0 = off)",
    )
    rec.add_argument("--ring-mb", type=int, default=16, metavar="MB", help="kernel ring buffer size (16)")
    rec.add_argument("--no-host", dest="host", action="store_false", help="skip scheduler/process/memory tracepoints")
    rec.add_argument("--no-io", dest="io", action="store_false", help="skip block I/O and TCP tracepoints")
    rec.add_argument(
        "--socket-rw",
        action="store_true",
        help="also record read(2)/write(2) on sockets (TLS clients, socket streams) as net_recv/net_send; "
        "off by default: every read and write on the host then passes a probe",
    )
    srv = p.add_argument_group("serving the agent API while tracing (same flags as 'ingero serve')")
    srv.add_argument("--listen", metavar="HOST:PORT", help="serve the agent API here while tracing")
    serve.add_server_args(p, srv)
    serve.add_limit_args(srv, hidden=True)
    ann = p.add_argument_group("annotations (Ingero's socket protocol; see 'ingero annotate --help')")
    ann.add_argument(
        "--annotate",
        action="store_true",
        help="take step/epoch/task labels on the socket /run/ingero/annotate.sock (~/.ingero/run/ when /run "
        "is not writable; an agent-owned 0700 directory, checked at start)",
    )
    ann.add_argument(
        "--annotate-socket-gid",
        type=int,
        metavar="GID",
        help="let this group connect too (directory 0750, socket 0660 of group GID)",
    )
    p.add_argument(
        "--inference",
        action="store_true",
        help="find serving engines (vLLM, SGLang, TGI, Triton) by command line, again every 5 s, and record their "
        "metrics endpoint once a second into engine_metrics (names as each engine publishes them)",
    )
    p.add_argument("--ready-file", metavar="PATH", help="write {pid, session, probes, url} as JSON here once recording")
    add_clickhouse_arg(p, "also ship the recording to the fleet's history in ClickHouse while tracing")
    metrics_flags.add_metrics_args(p)
    p.set_defaults(func=run)


def options_from(args: argparse.Namespace) -> TraceOptions:
    from ingero.agent.trace.procfilter import resolve_users
    from ingero.agent.trace.tracer import TraceOptions, parse_size
    from ingero.errors import UsageError
    from ingero.timeutil import parse_duration

    duration = parse_duration(args.duration) / 1e9 if args.duration else None
    if duration is not None and duration <= 0:
        raise UsageError("--duration must be positive")
    max_db = 0 if str(args.max_db).strip() in ("0", "off") else parse_size(args.max_db)
    if args.stack_samples < 0:
        raise UsageError("--stack-samples must be 0 (no limit) or more")
    if args.sample_budget < 1:
        raise UsageError("--sample-budget must be at least 1")
    if not 1 <= args.ring_mb <= 1024:
        raise UsageError("--ring-mb must be between 1 and 1024")
    listen = None
    if args.listen:
        from ingero.agent.api.server import bind_socket, serve_api
        from ingero.tools.http import node_tools

        settings = serve.settings_from(args, recording=False)
        # bound now and kept: a busy port fails in one line before any probe is attached, and nobody can
        # take the port while the probes compile
        sock = bind_socket(settings.host, settings.port, settings.backlog)
        serve.warn_about_exposure(settings)
        listen = functools.partial(serve_api, settings, app_wrapper=node_tools(settings), sock=sock)
    elif args.no_tls or args.tls_cert or args.client_ca or args.token or args.token_file or args.insecure_no_auth:
        raise UsageError("TLS/token flags need --listen", hint="add --listen HOST:PORT to serve while tracing")
    if args.socket_rw and not args.io:
        raise UsageError("--socket-rw records socket I/O, which --no-io turns off", hint="drop one of the two")
    if args.annotate_socket_gid is not None:
        if not args.annotate:
            raise UsageError("--annotate-socket-gid needs --annotate")
        if args.annotate_socket_gid < 0:
            raise UsageError("--annotate-socket-gid must be a group id (>= 0)")
    if args.annotate:  # an unsafe socket directory refuses now, in one line, before any probe is attached
        from ingero.agent.trace.annotate_socket import prepare_dir

        prepare_dir(gid=args.annotate_socket_gid)
    raw_db = str(common.db_path_from(args))
    uids = resolve_users(args.user)
    return TraceOptions(
        db_path=Path(raw_db).expanduser(),
        identity=common.identity_from(args),
        pids=pids_from(args.pid, uids),
        uids=uids,
        overrides={"cudart": args.cuda_lib, "cuda": args.driver_lib, "nccl": args.nccl_lib},
        duration_s=duration,
        stack_mode=args.stack,
        store_mode=args.store,
        budget_per_s=args.sample_budget,
        stack_samples=args.stack_samples,
        python_frames=args.python_frames,
        max_db_bytes=max_db,
        ring_mb=args.ring_mb,
        host=args.host,
        io=args.io,
        socket_rw=args.socket_rw,
        follow=args.follow,
        system_search=args.system_search,
        output=args.output,
        serve=listen,
        annotate=args.annotate,
        annotate_gid=args.annotate_socket_gid,
        inference=args.inference,
    )


def pids_from(pid_args: list[str], uids: list[int]) -> list[int]:
    """--pid values (repeatable, comma-separated) and the processes of each --user running now."""
    from ingero.agent.trace.procfilter import parse_pid_list, pids_of_uids

    return sorted(set(parse_pid_list(pid_args)) | set(pids_of_uids(uids) if uids else ()))


def run(args: argparse.Namespace) -> int:
    import trio

    from ingero.agent.trace.probes import preflight

    preflight()  # not root / no bcc / no tracefs: one line and the fix, before anything else
    if not args.db:
        args.db = str(common.db_path_from(args))
    opts = options_from(args)
    ready = Path(args.ready_file).expanduser() if args.ready_file else None
    exporters = metrics_flags.start(args, opts.identity, opts.db_path, "trace")
    if exporters is not None:
        from ingero.cli.output import note

        opts.observer = exporters.observer
        for line in exporters.lines:
            note(line)
    shipping = None
    if getattr(args, "clickhouse", None):
        from ingero.cli.clickhouse import start_shipping

        shipping = start_shipping(args, opts.db_path)  # its own thread: a down store never slows recording
    try:
        reason = trio.run(_trace, opts, ready)
    finally:
        if shipping is not None:
            shipping.stop()
            if shipping.error is not None:
                from ingero.cli.output import warn

                warn(f"shipping to ClickHouse stopped: {shipping.error}")
        if exporters is not None:
            exporters.close()
        if ready is not None:
            serve.remove_ready_file(ready)
    return 130 if reason == "SIGINT" else 0  # Ctrl-C: the recording is kept, and the exit says 130 as everywhere


async def _trace(opts: TraceOptions, ready_file: Path | None) -> str:
    """Run the tracer; readiness comes back through ``task_status`` (never scraped from output):
    the --ready-file is written first, then the view prints the banner. Returns why it stopped."""
    import trio

    from ingero.agent.trace.tracer import run_trace
    from ingero.cli.trace_view import TraceView

    view = TraceView(opts)
    reasons: list[str] = []

    async def tracer(task_status: trio.TaskStatus[TraceReady] = trio.TASK_STATUS_IGNORED) -> None:
        reasons.append((await run_trace(opts, view=view, task_status=task_status)).reason)

    try:
        async with trio.open_nursery() as nursery:
            ready: TraceReady = await nursery.start(tracer)
            if ready_file is not None:
                _write_ready(ready_file, ready)
            view.started(ready)
    except BaseExceptionGroup as group:  # the tracer's own error (one line), not trio's wrapping of it
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return reasons[0] if reasons else "stopped"


def _write_ready(path: Path, info: TraceReady) -> None:
    serve.write_ready_json(
        path,
        {
            "pid": os.getpid(),
            "session": info.session_id,
            "probes": info.probes,
            "libraries": [{"kind": a.kind, "path": a.path, "functions": len(a.probes)} for a in info.libraries],
            "url": info.server.url if info.server else None,
            "port": info.server.port if info.server else None,
            "fingerprint_sha256": info.server.fingerprint_sha256 if info.server else None,
            "annotate_socket": str(info.annotate_socket) if info.annotate_socket else None,
        },
    )
