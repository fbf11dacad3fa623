"""The ClickHouse layout of the fleet's history: which tables are shipped, their columns, and the DDL.

Columns are never listed here: they are read from ingero's own SQLite schema
(:func:`ingero.store.schema.migrate` on an in-memory database), so the ClickHouse tables follow the
SQLite ones column for column (``INTEGER`` → ``Int64``, ``REAL`` → ``Float64``, ``TEXT`` → ``String``; a
column SQLite allows to be NULL becomes ``Nullable``). Timestamps stay ``Int64`` Unix nanoseconds.
Tables without a ``node`` column in SQLite (``stack_traces``, ``process_names``, ...) gain one: the
shipper fills it with the recording's node, so every row of the store says where it came from.

Per shard, each table is a ``ReplacingMergeTree`` named ``<table>_local``, ordered by the row's
identity (:attr:`Table.key`, always led by ``node``); over it, a ``Distributed`` table takes the
plain name (``events``), sharded by ``sipHash64(node)``: one node's rows live on one shard, and
``SELECT … FROM events`` through any server sees the whole cluster.

Idempotency: ``ReplacingMergeTree`` by row identity, not insert deduplication by batch. Block
deduplication exists only for ``Replicated*`` tables (and, since 21.x, behind a setting for plain
ones), so it cannot hold on a ZooKeeper-free cluster; a row identity can. The shipper also avoids
duplicates in the first place (it probes for a batch whose answer it never saw, see
:mod:`ingero.clickhouse.shipper`), so plain ``count()`` is exact without ``FINAL``; a duplicate that
slipped through anyway collapses at the next merge, and ``FINAL`` hides it before then.

The SQL is kept to what ClickHouse 18.16 (Debian's) and current releases both run: no ``ON CLUSTER``
(it needs ZooKeeper/Keeper), the ``PARTITION BY … ORDER BY`` table syntax, ``CREATE TABLE … AS``.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from functools import cache

from ingero.errors import UsageError
from ingero.store.schema import migrate

LOCAL_SUFFIX = "_local"
SHARDING_KEY = "sipHash64(node)"
NS_PER_DAY = 86_400 * 1_000_000_000
_SQLITE_TYPES = {"INTEGER": "Int64", "REAL": "Float64", "TEXT": "String"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # ClickHouse type
    in_sqlite: bool  # False: added here (``node`` of a table without one)


@dataclass(frozen=True)
class Table:
    """One shipped table: its identity columns, and the time column that partitions it (if any)."""

    name: str
    key: tuple[str, ...]  # ReplacingMergeTree ORDER BY: the row's identity, led by node
    time: str | None = None  # Int64 ns column partitioning by day
    closed_after_ns: int | None = None  # rows are updated in place until this long after their time column
    # keyed: the rowid is the key itself (INTEGER PRIMARY KEY: a stack hash, a pid), not an insertion
    # order, so the shipper sends the rows whose key the store lacks instead of following the rowid
    keyed: bool = False
    # keyed tables only: a column the recorder updates in place (a session's stopped_at); a row whose
    # value changed is sent again (ReplacingMergeTree keeps the last one sent; readers use FINAL)
    version: str | None = None

    @property
    def local(self) -> str:
        return self.name + LOCAL_SUFFIX

    @property
    def columns(self) -> tuple[Column, ...]:
        return _columns(self.name)

    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


# What can be shipped, in shipping order (events last: the rows it points at are already there).
DECLARED: tuple[Table, ...] = (
    Table("sessions", ("node", "id"), "started_at", keyed=True, version="stopped_at"),
    Table("process_names", ("node", "pid"), keyed=True),
    Table("cgroup_metadata", ("node", "cgroup_id"), keyed=True),
    Table("stack_traces", ("node", "hash"), keyed=True),
    Table("nccl_comms", ("node", "pid", "comm")),
    Table("system_snapshots", ("node", "timestamp"), "timestamp"),
    Table("annotations", ("node", "id"), "timestamp"),
    Table("causal_chains", ("node", "id"), "detected_at"),
    # minute buckets are updated in place while their minute (and the writer's flush) is open
    Table("event_aggregates", ("node", "bucket", "source", "op", "pid"), "bucket", closed_after_ns=180 * 10**9),
    Table("nccl_calls", ("node", "pid", "tid", "timestamp"), "timestamp"),
    Table("engine_metrics", ("node", "ts", "pid", "engine", "metric", "labels"), "ts"),  # from schema 5
    Table("events", ("node", "timestamp", "id"), "timestamp"),
)


@cache
def _reference() -> dict[str, list[tuple[str, str, bool]]]:
    """Every declared table's SQLite columns in ingero's schema: (name, declared type, never NULL); none
    for a table this version's schema does not create."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        migrate(conn)
        return {
            t.name: [
                (r[1], (r[2] or "").upper(), bool(r[3] or r[5])) for r in conn.execute(f"PRAGMA table_info({t.name})")
            ]
            for t in DECLARED
        }
    finally:
        conn.close()


# What is shipped: the declared tables ingero's schema has.
TABLES: tuple[Table, ...] = tuple(t for t in DECLARED if _reference()[t.name])
BY_NAME = {t.name: t for t in TABLES}


@cache
def _columns(table: str) -> tuple[Column, ...]:
    cols: list[Column] = []
    for name, decl, not_null in _reference()[table]:
        ch = _SQLITE_TYPES[decl]
        cols.append(Column(name, ch if not_null else f"Nullable({ch})", True))
    if not any(c.name == "node" for c in cols):
        cols.append(Column("node", "String", False))
    return tuple(cols)


def check_name(text: str, what: str) -> str:
    """A cluster or database name as an identifier (it is spliced into DDL)."""
    if not _NAME.match(text):
        raise UsageError(f"{what} {text!r} is not a plain identifier", hint="letters, digits and '_' only")
    return text


def local_ddl(table: Table, database: str) -> str:
    cols = ",\n    ".join(f"`{c.name}` {c.type}" for c in table.columns)
    partition = f"PARTITION BY intDiv(`{table.time}`, {NS_PER_DAY}) " if table.time else ""
    return (
        f"CREATE TABLE IF NOT EXISTS {database}.{table.local} (\n    {cols}\n) "
        f"ENGINE = ReplacingMergeTree() {partition}ORDER BY ({', '.join(table.key)})"
    )


def distributed_ddl(table: Table, database: str, cluster: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {database}.{table.name} AS {database}.{table.local} "
        f"ENGINE = Distributed({cluster}, {database}, {table.local}, {SHARDING_KEY})"
    )


def ddl(cluster: str, database: str = "default") -> list[str]:
    """The statements to run on every server of the cluster (each is idempotent)."""
    check_name(cluster, "cluster")
    check_name(database, "database")
    out = [f"CREATE DATABASE IF NOT EXISTS {database}"]
    out += [local_ddl(t, database) for t in TABLES]
    out += [distributed_ddl(t, database, cluster) for t in TABLES]
    return out
