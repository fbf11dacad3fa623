"""The tools over one local trace database (and this host): blocking functions returning JSON-able dicts.

Each opens its own read-only connection (:func:`ingero.store.db.open_readonly`); free SQL goes
through the SQL guard (:func:`ingero.store.guard.run_query`). Invalid input raises
:class:`~ingero.errors.UsageError` with a one-line message every surface turns into a ``validation``
failure. Names follow Ingero's MCP tools (``get_trace_stats``, ``get_causal_chains``, ``run_sql``,
``get_stacks``, ``get_check``, ``run_demo``, ``event_history``) plus our ``processes``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from ingero.demo.scenarios import SCENARIOS
from ingero.errors import QueryTimeoutError, StoreError, UsageError
from ingero.explain.model import SEVERITIES, Chain, sort_chains, stored_chains
from ingero.store import guard
from ingero.store.catalog import GPU_API_SOURCES, IO, SOURCE_NAMES, lookup_op, op_name
from ingero.store.db import open_readonly, summarize, translate
from ingero.store.window import Window, resolve_window
from ingero.timeutil import fmt_duration, parse_duration
from ingero.tools.registry import ToolEnv, iso_us, tool

MAX_SQL_ROWS = 1000
DEFAULT_SQL_ROWS = 200
MAX_ITEMS = 100
TOP_OPS = 10  # get_trace_stats: slowest ops by total time
TOP_CHAINS = 5  # get_trace_stats: one line per strongest chain
ANALYSIS_TIMEOUT_S = 30.0  # statistics and explain on one database (free SQL has the guard's own limit)


# --- input validation --------------------------------------------------------------------------


def check_since(since: str | None) -> str | None:
    """``since`` must be a positive duration (30s, 5m, 2h) or empty."""
    if since is None or not since.strip():
        return None
    text = since.strip()
    try:
        span = parse_duration(text)
    except UsageError:
        raise UsageError(f"since={since!r} is not a duration", hint="use e.g. 30s, 5m, 2h") from None
    if span <= 0:
        raise UsageError(f"since={since!r} must be positive")
    return text


def check_limit(limit: int, name: str = "limit", maximum: int = MAX_ITEMS) -> int:
    if limit < 1 or limit > maximum:
        raise UsageError(f"{name}={limit} is out of range (1..{maximum})")
    return limit


def check_severity(severity: str | None) -> str | None:
    if not severity:
        return None
    sev = severity.strip().upper()
    if sev not in SEVERITIES:
        raise UsageError(f"severity={severity!r} is not one of {', '.join(SEVERITIES)}")
    return sev


@contextmanager
def _reader(db: Path, budget_s: float = ANALYSIS_TIMEOUT_S) -> Iterator[sqlite3.Connection]:
    """A read-only connection whose statements stop ``budget_s`` after it opened: a failure after the
    deadline passed is this tool's timeout (whatever layer translated the interrupted statement)."""
    conn = open_readonly(db)
    deadline = time.monotonic() + budget_s
    conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 10_000)
    try:
        yield conn
    except (sqlite3.Error, StoreError) as e:
        if time.monotonic() > deadline:
            raise QueryTimeoutError(
                f"analysis stopped at its {budget_s:g} s limit", hint="ask for a shorter window (since=5m)"
            ) from None
        if isinstance(e, sqlite3.Error):
            raise translate(e, db) from None
        raise
    finally:
        conn.close()


def _window(conn: sqlite3.Connection, since: str | None) -> Window:
    return resolve_window(conn, check_since(since))


def window_dict(window: Window) -> dict[str, Any]:
    """The window a tool used, its bounds in ISO-8601 (µs)."""
    return {"start": iso_us(window.start_ns), "end": iso_us(window.end_ns), "note": window.note}


def chain_dict(c: Chain) -> dict[str, Any]:
    d = c.as_dict()
    d["detected_at"] = iso_us(c.detected_at)
    return d


# argument types: each bound stated once, in the schema every surface publishes
Since = Annotated[
    str | None, Field(description="a duration such as 30s, 5m, 2h (on a finished recording: back from its end)")
]
Node = Annotated[str | None, Field(description="only this node's data")]
Items = Annotated[int, Field(ge=1, le=MAX_ITEMS, description=f"at most this many items (1..{MAX_ITEMS})")]
SqlRows = Annotated[int, Field(ge=1, le=MAX_SQL_ROWS, description=f"rows returned (1..{MAX_SQL_ROWS})")]
Severity = Literal["HIGH", "MEDIUM", "LOW"]
if TYPE_CHECKING:
    DemoScenario = str
else:  # the enum published in the schema is the scenario catalog itself
    DemoScenario = Literal[tuple(SCENARIOS)]


def _node_clause(node: str | None, column: str = "node") -> tuple[str, list[Any]]:
    return (f" AND {column} = ?", [node]) if node else ("", [])


# --- tools -------------------------------------------------------------------------------------


@tool("Trace statistics", scope="local")
def get_trace_stats(env: ToolEnv, since: Since = None) -> dict[str, Any]:
    """What the trace database holds: nodes, time span, event mix per node, the slowest ops (p50/p95/p99,
    tail ratio) and causal-chain counts by severity. Start here."""
    from ingero.explain.engine import explain

    db = env.need_db()
    with _reader(db) as conn:
        s = summarize(conn, db)
        window = _window(conn, since)
        where, params = window.clause("timestamp")
        mix = conn.execute(
            f"SELECT node, source, count(*) FROM events WHERE {where} GROUP BY node, source", params
        ).fetchall()
        report = explain(conn, window)
    by_node: dict[str, dict[str, int]] = {}
    for node, source, count in mix:
        by_node.setdefault(node, {})[SOURCE_NAMES.get(source, str(source))] = count
    counts = {sev: 0 for sev in SEVERITIES}
    for c in report.chains:
        counts[c.severity] = counts.get(c.severity, 0) + 1
    ops = sorted(report.ops, key=lambda o: o.total_ns, reverse=True)[:TOP_OPS]
    return {
        "database": db.name,
        "layout": s.layout,
        "nodes": s.nodes or sorted(by_node),
        "events": s.events,
        "first_event": iso_us(s.first_ns),
        "last_event": iso_us(s.last_ns),
        "span": fmt_duration(s.last_ns - s.first_ns) if s.first_ns and s.last_ns else None,
        "live": s.live,
        "stored_chains": s.chains,
        "window": window_dict(window),
        "events_in_window_by_node": by_node,
        "top_ops_by_total_time": [o.as_dict() for o in ops],
        "chain_counts": counts,
        "top_chains": [f"[{c.severity}] {c.node}: {c.summary}" for c in report.chains[:TOP_CHAINS]],
        "limits": {"top_ops_by_total_time": TOP_OPS, "top_chains": TOP_CHAINS},
        "notes": report.notes,
        "next_steps": "get_causal_chains() for root causes; get_stacks(op) for the code behind a slow op; "
        "processes() for who is busy; run_sql() for anything else",
    }


@tool("Causal chains", scope="local")
def get_causal_chains(
    env: ToolEnv, since: Since = None, severity: Severity | None = None, node: Node = None, limit: Items = 20
) -> dict[str, Any]:
    """Causal chains (GPU symptom -> host cause -> fix), most severe first: computed by the explain engine
    over the window, plus those stored in the database, and the wall-time ledger of every GPU thread
    (its time in GPU calls, own host code, preempted, asleep by waker, not recorded). severity: only
    HIGH, MEDIUM or LOW."""
    from ingero.explain.engine import explain
    from ingero.explain.ledger import describe

    db = env.need_db()
    sev = check_severity(severity)
    check_limit(limit)
    with _reader(db) as conn:
        window = _window(conn, since)
        report = explain(conn, window, node=node or None)
        stored = stored_chains(conn, window)
    found: dict[str, Chain] = {c.id: c for c in stored}
    for c in report.chains:
        found[c.id] = c  # a fresh computation replaces the stored row with the same id
    picked = [
        c for c in sort_chains(list(found.values())) if (not sev or c.severity == sev) and (not node or c.node == node)
    ]
    return {
        "window": window_dict(window),
        "count": len(picked),
        "limit": limit,
        "chains": [chain_dict(c) for c in picked[:limit]],
        "truncated": len(picked) > limit,
        # where each GPU thread's wall time went (buckets add up to wall_ns: see ingero.explain.ledger)
        "ledger": [{**r.as_dict(), "summary": describe(r)} for r in report.ledger if not node or r.node == node],
        "notes": report.notes,
    }


@tool("Read-only SQL", scope="local")
def run_sql(env: ToolEnv, query: str, limit: SqlRows = DEFAULT_SQL_ROWS) -> dict[str, Any]:
    """Run one read-only SQL statement (SQLite) on the trace database; writes, ATTACH and PRAGMA writes
    are refused, queries stop after 2 s. Tables: events, stack_traces, causal_chains, sources, ops,
    sessions, system_snapshots, process_names. Timestamps and durations are nanoseconds."""
    db = env.need_db()
    if not isinstance(query, str) or not query.strip():
        raise UsageError("sql is empty", hint="give one SELECT statement")
    check_limit(limit, "limit", MAX_SQL_ROWS)
    result = guard.run_query(db, query, limit=limit)
    return {**result.as_dict(), "limit": limit}


def _frames(text: str | None) -> list[str]:
    try:
        frames = json.loads(text or "[]")
    except ValueError:
        return [text or ""]
    out = []
    for f in frames if isinstance(frames, list) else []:
        if isinstance(f, dict):
            where = f.get("s") or f.get("i") or "?"
            out.append(f"{where} ({f['f']})" if f.get("f") else str(where))
    return out


@tool("Call stacks of an op", scope="local")
def get_stacks(env: ToolEnv, op: str, since: Since = None, node: Node = None, limit: Items = 10) -> dict[str, Any]:
    """Call stacks behind one op (e.g. cudaMalloc, cuLaunchKernel, cudaStreamSynchronize), most frequent
    first, with calls, share, average and max latency and the resolved frames."""
    db = env.need_db()
    if not isinstance(op, str) or not op.strip():
        raise UsageError("op is empty", hint="e.g. cudaMalloc, cuLaunchKernel, cudaStreamSynchronize")
    ref = lookup_op(op)
    check_limit(limit)
    node_sql, node_params = _node_clause(node, "e.node")
    with _reader(db) as conn:
        window = _window(conn, since)
        where, params = window.clause("e.timestamp")
        base = f"FROM events e WHERE e.source = ? AND e.op = ? AND {where}{node_sql}"
        args = [ref.source, ref.op, *params, *node_params]
        total, with_stack = conn.execute(f"SELECT count(*), total(e.stack_hash != 0) {base}", args).fetchone()
        rows = conn.execute(
            f"SELECT e.stack_hash, count(*) AS calls, avg(e.duration), max(e.duration), "
            f"group_concat(DISTINCT e.node) {base} AND e.stack_hash != 0 "
            "GROUP BY e.stack_hash ORDER BY calls DESC, e.stack_hash LIMIT ?",
            [*args, limit],
        ).fetchall()
        frames: dict[int, str] = {}
        for h, *_ in rows:
            row = conn.execute("SELECT frames FROM stack_traces WHERE hash = ?", (h,)).fetchone()
            frames[h] = row[0] if row else ""
    return {
        "op": ref.name,
        "window": window_dict(window),
        "limit": limit,
        "calls": int(total or 0),
        "calls_with_stack": int(with_stack or 0),
        "stacks": [
            {
                "stack_hash": h,
                "calls": calls,
                "share": round(calls / total, 4) if total else 0.0,
                "avg_us": round(avg / 1000, 3),
                "max_us": round(mx / 1000, 3),
                "nodes": sorted((nodes or "").split(",")),
                "frames": _frames(frames.get(h)) or ["(stack not resolved in this database)"],
            }
            for h, calls, avg, mx, nodes in rows
        ],
        "notes": [] if total else [f"no {ref.name} events in the window"],
    }


@tool("Processes", scope="local")
def processes(env: ToolEnv, since: Since = None, node: Node = None, limit: Items = 20) -> dict[str, Any]:
    """Per-process breakdown: GPU API calls and time, off-CPU time (sched_switch), block I/O, busiest GPU
    op — who is busy and who is waiting."""
    db = env.need_db()
    check_limit(limit)
    gpu = ",".join(str(s) for s in GPU_API_SOURCES)
    sched = lookup_op("sched_switch")
    switch = f"source = {sched.source} AND op = {sched.op}"
    node_sql, node_params = _node_clause(node)
    with _reader(db) as conn:
        window = _window(conn, since)
        where, params = window.clause("timestamp")
        args = [*params, *node_params]
        rows = conn.execute(
            "SELECT node, pid, count(*), "
            f"sum(source IN ({gpu})), total(CASE WHEN source IN ({gpu}) THEN duration END), "
            f"sum({switch}), total(CASE WHEN {switch} THEN duration END), "
            f"sum(source = {IO}), total(CASE WHEN source = {IO} THEN duration END), min(timestamp), max(timestamp) "
            f"FROM events WHERE {where}{node_sql} GROUP BY node, pid "
            "ORDER BY 5 DESC, 7 DESC, 3 DESC LIMIT ?",
            [*args, limit],
        ).fetchall()
        top: dict[tuple[str, int], tuple[int, int, int, float]] = {}
        for n, pid, source, op, count, tot in conn.execute(
            f"SELECT node, pid, source, op, count(*), total(duration) FROM events WHERE {where}{node_sql} "
            f"AND source IN ({gpu}) GROUP BY node, pid, source, op",
            args,
        ):
            if (n, pid) not in top or tot > top[(n, pid)][3]:
                top[(n, pid)] = (source, op, count, tot)
        names = _names(conn)
    out = []
    for n, pid, count, gcalls, gtime, sw, off, io, io_t, first, last in rows:
        best = top.get((n, pid))
        out.append(
            {
                "node": n,
                "pid": pid,
                "name": names.get((n, pid)) or names.get(("", pid)) or "",
                "events": count,
                "gpu_api_calls": int(gcalls or 0),
                "gpu_api_ms": round(gtime / 1e6, 3),
                "sched_switch": int(sw or 0),
                "offcpu_ms": round(off / 1e6, 3),
                "block_io": int(io or 0),
                "block_io_ms": round(io_t / 1e6, 3),
                "busiest_gpu_op": (
                    {"op": op_name(best[0], best[1]), "calls": best[2], "total_ms": round(best[3] / 1e6, 3)}
                    if best
                    else None
                ),
                "first_event": iso_us(first),
                "last_event": iso_us(last),
            }
        )
    return {"window": window_dict(window), "limit": limit, "processes": out, "truncated": len(out) >= limit}


def _names(conn: sqlite3.Connection) -> dict[tuple[str, int], str]:
    names: dict[tuple[str, int], str] = {}
    for sql_text, per_node in (
        ("SELECT pid, name FROM process_names", False),
        ("SELECT node, pid, name FROM node_process_names", True),
    ):
        try:
            for row in conn.execute(sql_text):
                key = (row[0], row[1]) if per_node else ("", row[0])
                names[key] = row[-1]
        except sqlite3.OperationalError:
            continue
    return names


@tool("Serving engines' metrics", scope="local")
def get_engine_metrics(env: ToolEnv, since: Since = None, node: Node = None) -> dict[str, Any]:
    """Serving engines recorded with `ingero trace --inference` (vLLM, SGLang, TGI, Triton): per engine
    process its scrapes and the last value of each series, named as the engine publishes them
    (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, sglang:token_usage, tgi_queue_size, ...), and the
    serving chains (KV-cache pressure, queue growth / TTFT regression) over the window."""
    from ingero.explain.rules_serving import serving_chains
    from ingero.store.engine_metrics import summary

    db = env.need_db()
    with _reader(db) as conn:
        window = _window(conn, since)
        engines = summary(conn, window.start_ns, window.end_ns, node or None)
        chains = serving_chains(conn, window, [], node or None)
    return {
        "window": window_dict(window),
        "engines": engines,
        "chains": [chain_dict(c) for c in sort_chains(chains)],
    }


@tool("Can this host trace?", scope="host")
def get_check(env: ToolEnv) -> dict[str, Any]:
    """Whether this machine can trace: kernel, BTF, headers, tracefs, uprobes, bcc, privileges, GPU
    libraries and driver, each with the fix when it fails (the checks of 'ingero check')."""
    from ingero.agent.trace.check import ready, run_checks

    results = run_checks()
    return {"ready": ready(results), "checks": [r.as_dict() for r in results]}


@tool("Run a demo scenario", scope="host")
def run_demo(env: ToolEnv, scenario: DemoScenario = "incident") -> dict[str, Any]:
    """Synthesise one demo scenario into a temporary database, explain it and return what explain found
    (the chains it must produce, the event count, the story). Deterministic; nothing is kept."""
    import tempfile

    from ingero.demo.runner import run_scenario

    with tempfile.TemporaryDirectory(prefix="ingero-demo-") as tmp:
        run = run_scenario(scenario, Path(tmp) / f"{scenario}.db")
    return {
        "scenario": scenario,
        "title": run.scenario.title,
        "story": run.scenario.story,
        "expect": run.scenario.expect,
        "events": run.events,
        "chains": [chain_dict(c) for c in run.report.chains[:MAX_ITEMS]],
        "notes": run.report.notes,
    }


def event_row(ts: int, node: str, pid: int, tid: int, source: int, op: int, duration: int | None) -> list[Any]:
    """One ``event_history`` row (columns ``EVENT_COLUMNS``), from the database's raw columns."""
    return [
        iso_us(ts),
        node,
        pid,
        tid,
        SOURCE_NAMES.get(source, str(source)),
        op_name(source, op),
        round((duration or 0) / 1000, 3),
    ]


def event_history_local(db: Path, since: str | None, node: str | None, op: str | None, limit: int) -> dict[str, Any]:
    """``event_history`` on one database (the tool itself is in :mod:`ingero.tools.fleet`: it also fans out)."""
    node_sql, node_params = _node_clause(node)
    op_sql, op_params = "", []
    if op:
        ref = lookup_op(op)
        op_sql, op_params = " AND source = ? AND op = ?", [ref.source, ref.op]
    with _reader(db) as conn:
        window = _window(conn, since)
        where, params = window.clause("timestamp")
        rows = conn.execute(
            f"SELECT timestamp, node, pid, tid, source, op, duration FROM events WHERE {where}{node_sql}{op_sql} "
            "ORDER BY timestamp DESC, id LIMIT ?",
            [*params, *node_params, *op_params, limit + 1],
        ).fetchall()
    return {
        "window": window_dict(window),
        "limit": limit,
        "truncated": len(rows) > limit,
        "columns": EVENT_COLUMNS,
        "rows": [event_row(*r) for r in rows[:limit]],
    }


EVENT_COLUMNS = ["time", "node", "pid", "tid", "source", "op", "duration_us"]
