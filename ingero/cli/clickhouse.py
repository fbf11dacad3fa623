"""``ingero clickhouse-schema`` and the ``--clickhouse URL`` side of query, explain, fleet stragglers and trace.

The fleet's history lives in ClickHouse (:mod:`ingero.clickhouse`); ``ingero ship`` (:mod:`ingero.cli.ship`)
puts recordings there. Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingero.cli import common
from ingero.cli.output import note

if TYPE_CHECKING:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.shipper import BackgroundShipping, Shipper, ShipResult
    from ingero.fleet.collective_ops import StragglerReport
    from ingero.store.guard import QueryResult
    from ingero.store.window import Window

EXAMPLES = """\
examples:
  ingero clickhouse-schema --cluster ingero                       print the DDL (run it on every server)
  ingero clickhouse-schema --cluster ingero --apply http://ch-1:8123,http://ch-2:8123
  ingero ship --db /var/lib/ingero/trace.db --clickhouse http://ch-1:8123 --follow
  ingero query --clickhouse http://ch-1:8123 "SELECT node, count() AS n FROM events GROUP BY node"

The cluster NAME is a <remote_servers> entry of every server's config. Each statement is idempotent
(IF NOT EXISTS) and is run on each server in turn: no ON CLUSTER, so no ZooKeeper/Keeper is needed.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "clickhouse-schema",
        parents=parents,
        help="the ClickHouse DDL of the fleet's history (sharded by node); --apply runs it on each server",
        description="Print (or run on each server) the DDL of the fleet's history: per-shard ReplacingMergeTree "
        "tables <name>_local and Distributed tables under the plain names (events, causal_chains, ...).",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("--cluster", required=True, metavar="NAME", help="the cluster (<remote_servers> entry)")
    p.add_argument("--database", default="default", metavar="DB", help="ClickHouse database (default: default)")
    p.add_argument("--apply", metavar="URL,URL…", help="run the DDL on each of these servers (HTTP interface)")
    p.set_defaults(func=run_schema)


def add_clickhouse_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    g = parser.add_argument_group("history (ClickHouse)")
    g.add_argument("--clickhouse", metavar="URL", help=help_text + " (any server's HTTP URL, e.g. http://ch-1:8123)")
    g.add_argument("--ch-database", default="default", metavar="DB", help="ClickHouse database (default: default)")


def connect(args: argparse.Namespace, *, readonly: bool = True) -> ClickHouse:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.query import READONLY_SETTINGS
    from ingero.clickhouse.schema import check_name

    check_name(getattr(args, "ch_database", "default"), "--ch-database")
    return ClickHouse(args.clickhouse, settings=READONLY_SETTINGS if readonly else None)


def run_schema(args: argparse.Namespace) -> int:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.schema import ddl

    statements = ddl(args.cluster, args.database)
    if not args.apply:
        print(";\n\n".join(statements) + ";")
        return 0
    for url in [u.strip() for u in args.apply.split(",") if u.strip()]:
        with ClickHouse(url) as ch:
            for sql in statements:
                ch.execute(sql)
        note(f"{url}: {len(statements)} statement(s) applied")
    return 0


# --- query / explain / stragglers over the store -------------------------------------------------


# without a statement: the latest events (ClickHouse 18.16 takes one JOIN per SELECT, so names come from no catalog)
DEFAULT_SQL = (
    "SELECT node, id, timestamp, source, op, duration/1000.0 AS dur_us, pid, tid, arg0, ret_code "
    "FROM events ORDER BY timestamp DESC"
)


def query_result(args: argparse.Namespace, sql: str) -> QueryResult:
    """``ingero query --clickhouse``: the statement, read-only, through one server (all shards)."""
    from ingero.clickhouse.query import run_query
    from ingero.errors import UsageError
    from ingero.store.budget import DEFAULT_TIMEOUT_MS

    if args.db or args.nodes or args.since or args.from_ or args.to or args.op or args.pid or args.annotations:
        raise UsageError(
            "--clickhouse takes the statement as written",
            hint="put the window and filters in the SQL (WHERE node = ... AND timestamp >= ...)",
        )
    with connect(args) as ch:
        return run_query(ch, sql, limit=args.limit, timeout_ms=args.timeout_ms or DEFAULT_TIMEOUT_MS)


def run_explain(args: argparse.Namespace, computed: Callable[..., int]) -> int:
    """Explain one node's window of the store: its rows loaded into a trace database, the same engine
    and output (``computed``: what ``ingero explain --db`` runs on a database and its window)."""
    from ingero.clickhouse.history import load_file, store_window
    from ingero.errors import UsageError
    from ingero.store.catalog import lookup_op
    from ingero.store.db import open_readonly

    if not args.node:
        raise UsageError("--clickhouse needs --node NAME", hint="the store holds every node: explain one at a time")
    if args.db or args.nodes or args.chains or args.per_cgroup or args.annotations:
        raise UsageError(
            "--clickhouse explains one node's computed chains (no --db/--nodes/--chains/--per-cgroup/--annotations)"
        )
    op_name = lookup_op(args.op).name if args.op else None
    with connect(args) as ch, tempfile.TemporaryDirectory(prefix="ingero-ch-") as tmp:
        window = store_window(ch, args.ch_database, args.since, args.from_, args.to, node=args.node)
        path = Path(tmp) / "window.db"
        load_file(ch, args.ch_database, args.node, window, path)
        conn = open_readonly(path)
        try:
            return computed(conn, args, ch.url, window, op_name)
        finally:
            conn.close()


ASSUMED_CLOCK_UNCERTAINTY_NS = 1_000_000  # stored rows carry no skew estimate: NTP-synced clocks, ±1 ms


def store_stragglers(args: argparse.Namespace) -> StragglerReport:
    """The collectives verdict over the store's window: every node's calls, the same join."""
    import sqlite3

    from ingero.clickhouse.history import COLLECTIVE_TABLES, load, nodes, store_window
    from ingero.fleet.collective_ops import StragglerReport, _span_s, collective_verdict
    from ingero.fleet.collectives import NodeCalls
    from ingero.fleet.cost import wait_cost
    from ingero.fleet.straggler import verdict, with_collectives
    from ingero.store.nccl import parse_comm, read_calls

    rates = common.config_from(args).fleet.gpu_hourly_usd
    comm = parse_comm(args.comm)
    calls: list[NodeCalls] = []
    truncated: list[str] = []
    with connect(args) as ch:
        window = store_window(ch, args.ch_database, args.since, args.from_, args.to, table="nccl_calls")
        if window.note:
            note(window.note)
        for node in nodes(ch, args.ch_database, "nccl_calls", window):
            conn = sqlite3.connect(":memory:", isolation_level=None)
            try:
                load(ch, args.ch_database, node, window, conn, COLLECTIVE_TABLES)
                body = read_calls(conn, window, comm=comm)
            finally:
                conn.close()
            if body.get("truncated"):
                truncated.append(node)
            calls.append(NodeCalls.from_body(node, body, 0.0, ASSUMED_CLOCK_UNCERTAINTY_NS))
    note(
        f"clocks: stored rows carry no skew estimate; assumed synchronised within ±{ASSUMED_CLOCK_UNCERTAINTY_NS / 1e6:g} ms"
    )
    cv = collective_verdict(calls) if any(len(c) for c in calls) else None
    v = with_collectives(verdict([]), cv)
    cost = wait_cost(cv.ranks if cv else [], rates, window_s=_span_s(calls))  # the job time the calls cover
    report = StragglerReport([], v, cost, truncated=truncated)
    if v.outlier:
        report.chain = _top_chain(args, v.outlier, window)
    return report


def _top_chain(args: argparse.Namespace, node: str, window: Window) -> dict[str, Any] | None:
    """The straggler's strongest explain chain over the same window of the store (as fan-out asks its agent)."""
    from ingero.clickhouse.history import load_file
    from ingero.explain.engine import explain
    from ingero.store.db import open_readonly

    with connect(args) as ch, tempfile.TemporaryDirectory(prefix="ingero-ch-") as tmp:
        path = Path(tmp) / "window.db"
        load_file(ch, args.ch_database, node, window, path)
        conn = open_readonly(path)
        try:
            chains = explain(conn, window, node=node).chains
        finally:
            conn.close()
    return chains[0].as_dict() if chains else None


# --- shipping from a tracer ----------------------------------------------------------------------


def ship_summary(result: ShipResult) -> str:
    parts = [f"{t.table} {t.rows}" for t in result.tables.values() if t.rows]
    rate = result.rows / result.elapsed_s if result.elapsed_s > 0 else 0.0
    return f"shipped {result.rows} row(s) in {result.elapsed_s:.2f}s ({rate:,.0f} rows/s)" + (
        f": {', '.join(parts)}" if parts else ""
    )


def open_shipper(args: argparse.Namespace, db: Path) -> Shipper:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.shipper import DEFAULT_BATCH_ROWS, Shipper

    ch = ClickHouse(args.clickhouse)
    try:
        return Shipper(
            db,
            ch,
            target=getattr(args, "ch_target", "default"),
            database=getattr(args, "ch_database", "default"),
            batch_rows=getattr(args, "batch_rows", None) or DEFAULT_BATCH_ROWS,
        )
    except BaseException:
        ch.close()
        raise


class RoundNotes:
    """What a following shipper says on stderr: each round's rows (``quiet``: not those), a stall once, the resume."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.stalled = False

    def __call__(self, result: ShipResult | None, error: str | None) -> None:
        if error is not None:
            if not self.stalled:
                note(f"shipping to ClickHouse stalled (recording goes on; retrying with backoff): {error}")
            self.stalled = True
            return
        if self.stalled:
            note("shipping to ClickHouse resumed")
            self.stalled = False
        if result is not None and result.rows and not self.quiet:
            note(ship_summary(result))


def start_shipping(args: argparse.Namespace, db: Path) -> BackgroundShipping:
    """``ingero trace --clickhouse``: ship the recording from a thread while it is written."""
    from ingero.clickhouse.client import ClickHouse, check_url
    from ingero.clickhouse.schema import check_name
    from ingero.clickhouse.shipper import BackgroundShipping

    url = check_url(args.clickhouse)
    database = check_name(getattr(args, "ch_database", "default"), "--ch-database")
    return BackgroundShipping(db, lambda: ClickHouse(url), on_round=RoundNotes(quiet=True), database=database).start()
