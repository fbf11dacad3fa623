"""What each agent API endpoint computes: blocking functions that run in worker threads.

Every function takes the :class:`AgentContext`, its validated arguments and the job's cancel event,
opens its own read-only connection (guarded by a progress-handler deadline that also watches the
cancel event) and returns the response body already encoded, so that even serialising a large
answer happens off the trio loop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingero import API_VERSION, __version__, compactjson
from ingero.agent.api.workers import Admission, Job
from ingero.clickhouse.progress import shipping_summary
from ingero.errors import QueryTimeoutError, StoreError, UsageError
from ingero.explain.memory_policy import gives_back  # the heavy requests: a long-lived agent trims after them
from ingero.identity import Identity
from ingero.store import guard
from ingero.store.budget import Deadline, QueryBudget, errorname
from ingero.store.catalog import lookup_op
from ingero.store.db import DbSummary, event_filter_sql, open_readonly, summarize, translate
from ingero.store.window import Window, resolve_window

if TYPE_CHECKING:
    from ingero.explain.engine import ExplainReport

TOP_OPS = 10
WINDOW_PARAMS = ("since", "from", "to")
# per_process=1: chains for each GPU process, as explain --per-process. explain --by / --annotation /
# --annotations over the fleet: by=KEY answers the by-label ledger alone; annotation=KEY=VALUE explains
# that value's span(s) (with its ledger line, "label"); annotations=1 adds the window's label summary
# ("labels"). steps=1 adds each node's step-gap summary ("steps": a fleet explain tells a late rank across
# nodes with it; computed only when asked). An agent older than these answers 400 (unknown parameter).
CHAINS_PARAMS = (*WINDOW_PARAMS, "per_process", "by", "annotation", "annotations", "steps")


@dataclass
class AgentContext:
    """Everything a request handler needs; built once per server by :mod:`ingero.agent.api.server`."""

    db_path: Path
    identity: Identity
    tls_mode: str  # "mtls" | "tls" | "plaintext"
    token: str | None
    budget: QueryBudget  # every row/time/size limit
    workers: Admission  # the lanes of worker threads (short, heavy, meta)
    instance: str = ""  # this agent's stable instance id (ingero.store.instance), sent with every answer

    @property
    def node(self) -> str:
        return self.identity.node

    @property
    def analysis_timeout_ms(self) -> int:
        return self.budget.analysis_timeout_ms

    @property
    def auth_mode(self) -> str:
        return "token" if self.token else "none"


# --- encoding ----------------------------------------------------------------------------------


def encode(doc: Mapping[str, Any]) -> bytes:
    return compactjson.dumps(doc).encode("utf-8", "surrogatepass")


def ok(ctx: AgentContext, **fields: Any) -> dict[str, Any]:
    return {"ok": True, "node": ctx.node, "instance": ctx.instance, **fields}


# --- connections with a deadline ---------------------------------------------------------------


@contextmanager
def reader(ctx: AgentContext, cancel: threading.Event) -> Iterator[sqlite3.Connection]:
    """A read-only connection whose statements stop at the analysis deadline or when ``cancel`` is set
    (a :class:`~ingero.agent.api.workers.Job` also moves to the heavy lane once past its quantum)."""
    budget = ctx.budget.analysis_timeout_ms
    conn = open_readonly(ctx.db_path, legacy_node=ctx.node, check_same_thread=False)
    deadline = Deadline(budget, cancel, cancel.checkpoint if isinstance(cancel, Job) else None)
    deadline.install(conn, 10_000)
    try:
        conn.execute("PRAGMA query_only = 1")
        yield conn
    except (sqlite3.Error, StoreError) as e:
        # an interrupt may arrive translated (a StoreError) from code that translates sqlite3 errors itself
        interrupted = errorname(e) == "SQLITE_INTERRUPT" or isinstance(e, StoreError)
        if interrupted and deadline.expired():
            raise QueryTimeoutError(
                f"analysis stopped at its {budget} ms limit", hint="ask for a shorter window (since=5m)"
            ) from None
        if isinstance(e, sqlite3.Error):
            raise translate(e, ctx.db_path) from None
        raise
    finally:
        conn.close()


def window_from_params(conn: sqlite3.Connection, params: Mapping[str, str]) -> Window:
    return resolve_window(conn, params.get("since") or None, params.get("from") or None, params.get("to") or None)


# --- endpoints ---------------------------------------------------------------------------------


def recorded_ranks(conn: sqlite3.Connection, node: str) -> tuple[int | None, int | None, int | None]:
    """rank, local_rank, world_size of this node's latest session that has them (a replayed recording)."""
    try:
        row = conn.execute(
            "SELECT rank, local_rank, world_size FROM sessions WHERE node = ? AND rank IS NOT NULL "
            "ORDER BY started_at DESC LIMIT 1",
            (node,),
        ).fetchone()
    except sqlite3.OperationalError:  # layouts without ranks
        return None, None, None
    return (row[0], row[1], row[2]) if row else (None, None, None)


def info_fields(ctx: AgentContext, s: DbSummary, conn: sqlite3.Connection) -> dict[str, Any]:
    """Identity and database facts. Ranks come from the agent's environment (RANK, LOCAL_RANK, WORLD_SIZE);
    an agent serving a recording without them reports the ranks the recording's sessions carry."""
    ident = ctx.identity
    rank, local_rank, world_size = ident.rank, ident.local_rank, ident.world_size
    if rank is None and local_rank is None and world_size is None:
        rank, local_rank, world_size = recorded_ranks(conn, ident.node)
    return {
        "node_source": ident.source,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "version": __version__,
        "api_version": API_VERSION,
        "schema_version": s.schema_version,
        "layout": s.layout,
        "events": s.events,
        "chains": s.chains,
        "stacks": s.stacks,
        "first_ns": s.first_ns,
        "last_ns": s.last_ns,
        "live": s.live,
        "shipping": shipping_summary(conn, time.time_ns()),  # to ClickHouse: None when never shipped
        "tls": ctx.tls_mode,
        "auth": ctx.auth_mode,
    }


def info(ctx: AgentContext, cancel: threading.Event) -> bytes:
    with reader(ctx, cancel) as conn:
        s = summarize(conn, ctx.db_path)
        fields = info_fields(ctx, s, conn)
    return encode(ok(ctx, **fields))


def query_timeout_ms(ctx: AgentContext, body: Mapping[str, Any]) -> int:
    """The query's budget: what it asked for, at most (and by default) the server's maximum."""
    return ctx.budget.timeout_ms(body.get("timeout_ms"))


@gives_back
def query(ctx: AgentContext, body: Mapping[str, Any], cancel: threading.Event) -> bytes:
    flt, window = None, None
    if any(body.get(k) is not None for k in (*WINDOW_PARAMS, "pid", "op")):
        flt, window = _event_filter(ctx, body, cancel)
    result = guard.run_query(
        ctx.db_path,
        body["sql"],
        limit=body.get("limit"),
        timeout_ms=body.get("timeout_ms"),
        budget=ctx.budget,
        legacy_node=ctx.node,
        event_filter=flt,
        cancel=cancel,
        checkpoint=cancel.checkpoint if isinstance(cancel, Job) else None,
    )
    doc = ok(ctx, **result.as_dict())
    if window is not None:
        doc["window"] = window.as_dict()
    return encode(doc)


def _event_filter(ctx: AgentContext, body: Mapping[str, Any], cancel: threading.Event) -> tuple[str | None, Window]:
    with reader(ctx, cancel) as conn:
        window = window_from_params(conn, {k: body[k] for k in WINDOW_PARAMS if body.get(k) is not None})
    source_op = None
    if body.get("op") is not None:
        ref = lookup_op(str(body["op"]))
        source_op = (ref.source, ref.op)
    return event_filter_sql(window.start_ns, window.end_ns, body.get("pid"), source_op), window


@gives_back
def ops(ctx: AgentContext, params: Mapping[str, str], cancel: threading.Event) -> bytes:
    from ingero.explain.stats import host_summary, op_stats
    from ingero.explain.storage import load_storage, with_true_counts

    with reader(ctx, cancel) as conn:
        window = window_from_params(conn, params)
        # sampled ops (selective storage): true counts and totals from event_aggregates, marked "sampled"
        stats = with_true_counts(op_stats(conn, window), load_storage(conn, window))
        host = host_summary(conn, window)
    return encode(ok(ctx, window=window.as_dict(), ops=[s.as_dict() for s in stats], host=host.as_dict()))


@gives_back
def chains(ctx: AgentContext, params: Mapping[str, str], cancel: threading.Event) -> bytes:
    from ingero.explain.model import stored_chains

    extra: dict[str, Any] = {}
    with reader(ctx, cancel) as conn:
        window = window_from_params(conn, params)
        if params.get("by"):
            return encode(ok(ctx, window=window.as_dict(), by=_by_label(conn, params["by"], window)))
        if params.get("annotations") in ("1", "true"):
            from ingero.store.annotation_join import label_summary

            extra["labels"] = label_summary(conn, window.start_ns, window.end_ns)
        pid = None
        if params.get("annotation"):
            label = _label(conn, params["annotation"], window)
            if label.get("missing"):  # no such span here: nothing of the window to explain
                return encode(ok(ctx, window=window.as_dict(), label=label, **extra))
            window, pid = label["window_of"], label["pid"]
            extra["label"] = {k: v for k, v in label.items() if k != "window_of"}
        steps = params.get("steps") in ("1", "true")
        computed = _explain(conn, window, per_process=params.get("per_process") in ("1", "true"), pid=pid, steps=steps)
        stored = stored_chains(conn, window)
    if steps:  # each node's step-gap summary: the client tells a late rank across nodes without NCCL rows
        extra["steps"] = [s.as_dict() for s in computed.steps]
    return encode(
        ok(
            ctx,
            window=window.as_dict(),
            chains=[c.as_dict() for c in computed.chains],
            stored=[c.as_dict() for c in stored],
            # the same figures /ops gives, from the one explain run: a fleet explain asks once per node
            ops=[o.as_dict() for o in computed.ops],
            host=computed.host.as_dict(),
            ledger=[r.as_dict() for r in computed.ledger],  # where each GPU thread's wall time went
            **extra,
        )
    )


def _by_label(conn: sqlite3.Connection, key: str, window: Window) -> dict[str, Any]:
    from ingero.explain.by_label import by_label

    return by_label(conn, key, window).as_dict()


def _label(conn: sqlite3.Connection, selector: str, window: Window) -> dict[str, Any]:
    """``annotation=step=12``: the span's window and process, and the value's ledger line; a node
    without that span says so (``missing``) rather than failing: the others may have it."""
    from ingero.explain.by_label import explain_value

    try:
        span, pid, key, value = explain_value(conn, selector, window)
    except UsageError as e:
        return {"selector": selector, "missing": e.message}
    return {"key": key, "pid": pid, "value": value.as_dict(), "window_of": span}


@gives_back
def overview(ctx: AgentContext, params: Mapping[str, str], cancel: threading.Event) -> bytes:
    with reader(ctx, cancel) as conn:
        s = summarize(conn, ctx.db_path)
        fields = info_fields(ctx, s, conn)
        window = window_from_params(conn, params)
        report = _explain(conn, window)
    counts = {sev: 0 for sev in ("HIGH", "MEDIUM", "LOW")}
    for c in report.chains:
        counts[c.severity] = counts.get(c.severity, 0) + 1
    return encode(
        ok(
            ctx,
            **fields,
            window=window.as_dict(),
            top_ops=[o.as_dict() for o in report.ops[:TOP_OPS]],
            chain_counts=counts,
            host=report.host.as_dict(),
        )
    )


def _explain(
    conn: sqlite3.Connection, window: Window, *, per_process: bool = False, pid: int | None = None, steps: bool = False
) -> ExplainReport:
    """Every node in this database (a merged cluster database served by one agent has several)."""
    from ingero.explain.engine import explain

    return explain(conn, window, per_process=per_process, pid=pid, steps=steps)


# --- request validation (runs on the loop: cheap) ----------------------------------------------

QUERY_FIELDS = ("sql", "limit", "timeout_ms", *WINDOW_PARAMS, "pid", "op")


def check_query_body(doc: Any) -> dict[str, Any]:
    """Validate a ``POST /query`` body; raise UsageError (400) naming the field."""
    if not isinstance(doc, dict):
        raise UsageError(f"the body must be a JSON object, got {_json_type(doc)}", hint='send {"sql": "SELECT ..."}')
    unknown = [k for k in doc if k not in QUERY_FIELDS]
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r}", hint="known fields: " + ", ".join(QUERY_FIELDS))
    if "sql" not in doc or doc["sql"] is None:
        raise UsageError("missing field 'sql'", hint='send {"sql": "SELECT ..."}')
    if not isinstance(doc["sql"], str):
        raise UsageError(f"field 'sql' must be a string, got {_json_type(doc['sql'])}")
    for key in ("limit", "timeout_ms", "pid"):
        v = doc.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(f"field {key!r} must be an integer, got {_json_type(v)}")
        if key != "pid" and v < 1:
            raise UsageError(f"field {key!r} must be at least 1, got {v}")
    for key in (*WINDOW_PARAMS, "op"):
        v = doc.get(key)
        if v is not None and not isinstance(v, str):
            raise UsageError(f"field {key!r} must be a string, got {_json_type(v)}")
    return doc


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"
