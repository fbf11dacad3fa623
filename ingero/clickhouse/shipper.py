"""Ship a recording's new rows to ClickHouse, resumably: per table, how far it got lives in the recording.

Progress is one row per (target, table) in the recording's own ``clickhouse_progress`` table (an
addition of ours, like ``node_seq``): ``shipped`` is the SQLite ``rowid`` of the last row known to be
in ClickHouse. A batch is the next rows by ``rowid``, cut where the node changes (so a batch goes to
one shard, as one block: all of it lands or none of it does). Before sending a batch the shipper
writes it down as ``pending`` with the identity of its last row; after ClickHouse answers, ``shipped``
moves to it. A batch whose answer was never seen (the shipper was killed, or a shard dropped the
connection after its rows were in: a synchronous ``Distributed`` insert can fail after writing) is
settled on the next run by a probe for that last row: present → the batch is done, absent → it is
sent again. So a re-run or a crash ships nothing twice and skips nothing; ``ReplacingMergeTree`` by
row identity (:mod:`ingero.clickhouse.schema`) is the second line.

The shipper only reads the recording (and writes its small progress row, in WAL mode): a down
cluster stalls shipping, never the tracer. :meth:`Shipper.follow` keeps going with bounded backoff
and resumes where it stopped; :func:`ingero.clickhouse.progress.lag` says how far behind it is.

Tables whose ``rowid`` is a key rather than an insertion order (a stack hash, a pid) and ``sessions``
(updated in place when they stop) are shipped by difference instead: the rows whose identity (and
version) the store lacks.

Rows are formatted as ``TabSeparated`` by SQLite itself: a one-node batch comes back as one value
(``group_concat`` of the rows' concatenated columns), so Python does no work per row.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ingero.clickhouse.client import ClickHouse, ch_literal
from ingero.clickhouse.progress import FIRST_ROWID, PROGRESS_DDL
from ingero.clickhouse.schema import TABLES, Table
from ingero.errors import ClickHouseUnavailableError, DatabaseNotFoundError
from ingero.store.db import is_live, recorded_node, translate
from ingero.timeutil import now_ns

DEFAULT_BATCH_ROWS = 100_000
INSERT_SETTINGS = {"insert_distributed_sync": 1}  # the answer means every shard has the rows


@dataclass
class TableProgress:
    table: str
    rows: int = 0  # shipped by this call
    batches: int = 0
    resent: int = 0  # pending batches found absent and sent again
    settled: int = 0  # pending batches found present (not sent again)


@dataclass
class ShipResult:
    tables: dict[str, TableProgress] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())


@dataclass
class _Batch:
    last_rowid: int
    body: bytes  # TabSeparated rows, each ending in a newline
    node: str
    rows: int


def _escape_sql(expr: str) -> str:
    """SQLite expression → its TabSeparated text (backslash, tab, newline, CR escaped)."""
    out = f"replace({expr}, '\\', '\\\\')"
    for ch, esc in (("char(9)", "\\t"), ("char(10)", "\\n"), ("char(13)", "\\r")):
        out = f"replace({out}, {ch}, '{esc}')"
    return out


def _text_sql(expr: str) -> str:
    """A text column's TabSeparated form, escaping only the rare value that needs it (cheaper than always)."""
    plain = f"instr({expr}, char(9)) + instr({expr}, char(10)) + instr({expr}, char(13)) + instr({expr}, '\\') = 0"
    return f"CASE WHEN {plain} THEN {expr} ELSE {_escape_sql(expr)} END"


def _line_sql(parts: list[str]) -> str:
    """One row's TabSeparated line from its column expressions: one ``printf`` (twice as fast as ``||``)."""
    return "printf('" + "\t".join("%s" for _ in parts) + "', " + ", ".join(parts) + ")"


def _tsv_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _sql_text_literal(v: str) -> str:
    """A SQLite string literal."""
    return "'" + v.replace("'", "''") + "'"


class Shipper:
    """Ships one recording to one ClickHouse store through ``ch`` (a server of the cluster)."""

    def __init__(
        self,
        db: str | Path,
        ch: ClickHouse,
        *,
        target: str = "default",
        database: str = "default",
        batch_rows: int = DEFAULT_BATCH_ROWS,
        tables: tuple[Table, ...] = TABLES,
    ) -> None:
        self.path = Path(db).expanduser()
        if not self.path.exists():
            raise DatabaseNotFoundError(f"no database at {self.path}")
        self.ch = ch
        self.target = target
        self.database = database
        self.batch_rows = max(1, batch_rows)
        self.tables = tables
        try:
            self.conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            self._have: set[str] = set()
            self.node = ""
            self._look()
        except sqlite3.Error as e:
            raise translate(e, self.path) from None
        self._keyed_seen: dict[str, tuple[int, float, float]] = {}
        self._read_conn: sqlite3.Connection | None = None
        self.last_error: str | None = None
        self.last_ok_ns: int | None = None

    def _look(self) -> None:
        """The recording's tables and node (a tracer that just started creates them after we open)."""
        self._have = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "events" in self._have and "clickhouse_progress" not in self._have:
            # only once the recording exists: a table of ours in an empty file would make it no trace database
            self.conn.execute(PROGRESS_DDL)
            self._have.add("clickhouse_progress")
        if not self.node and "events" in self._have:
            self.node = recorded_node(self.conn) or ""

    def close(self) -> None:
        if self._read_conn is not None:
            self._read_conn.close()
        self.conn.close()

    def __enter__(self) -> Shipper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- progress -------------------------------------------------------------------------------

    def _progress(self, table: str) -> tuple[int, int | None, str | None, int]:
        row = self.conn.execute(
            "SELECT shipped, pending, pending_key, pending_rows FROM clickhouse_progress WHERE target = ? AND tbl = ?",
            (self.target, table),
        ).fetchone()
        if row is None:
            return FIRST_ROWID, None, None, 0
        return int(row[0]), row[1], row[2], int(row[3])

    def _set_pending(self, table: str, rowid: int, key: str, rows: int) -> None:
        self.conn.execute(
            "INSERT INTO clickhouse_progress(target, tbl, shipped, pending, pending_key, pending_rows, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(target, tbl) DO UPDATE SET pending = excluded.pending, "
            "pending_key = excluded.pending_key, pending_rows = excluded.pending_rows, updated_at = excluded.updated_at",
            (self.target, table, FIRST_ROWID, rowid, key, rows, now_ns()),
        )

    def _settle(self, table: str, landed: bool) -> None:
        """The pending batch is in ClickHouse (``landed``: ``shipped`` moves to it) or is to be resent."""
        if landed:
            self.conn.execute(
                "UPDATE clickhouse_progress SET shipped = pending, rows = rows + pending_rows, pending = NULL, "
                "pending_key = NULL, pending_rows = 0, updated_at = ? WHERE target = ? AND tbl = ?",
                (now_ns(), self.target, table),
            )
        else:
            self.conn.execute(
                "UPDATE clickhouse_progress SET pending = NULL, pending_key = NULL, pending_rows = 0 "
                "WHERE target = ? AND tbl = ?",
                (self.target, table),
            )

    # --- reading --------------------------------------------------------------------------------

    def _columns(self, table: Table) -> tuple[list[str], list[str]]:
        """(ClickHouse columns sent, SQLite expressions of the TabSeparated line) for this recording."""
        have = self._sqlite_columns(table)
        names: list[str] = []
        parts: list[str] = []
        for c in table.columns:
            if c.in_sqlite and c.name not in have and c.name != "node":
                continue  # an older layout: ClickHouse fills the column's default
            names.append(c.name)
            if c.name not in have:  # node, of a table without one (or an older layout's): the recording's
                parts.append(_sql_text_literal(_tsv_value(self.node)))
            else:
                expr = f'"{c.name}"'
                if "String" in c.type:
                    expr = _text_sql(expr)
                parts.append(f"ifnull({expr}, '\\N')" if c.type.startswith("Nullable") else expr)
        return names, parts

    def _sqlite_columns(self, table: Table) -> set[str]:
        """The recording's own columns of ``table`` (an older layout lacks later ones: ``node`` of
        ``event_aggregates`` before schema 6, of ``system_snapshots`` before schema 2)."""
        return {r[1] for r in self.conn.execute(f"PRAGMA table_info({table.name})")}

    def _read(
        self, conn: sqlite3.Connection, table: Table, after: int, parts: list[str], closed_before: int | None
    ) -> _Batch | None:
        node_expr = '"node"' if "node" in self._sqlite_columns(table) else "''"
        time_expr = f'"{table.time}"' if table.time else "0"
        line = _line_sql(parts)
        window = f"{table.name} WHERE rowid > ? ORDER BY rowid LIMIT ?"
        if closed_before is None:
            # the usual batch (one node): built whole by SQLite, one value back
            n, nodes, node, last, body = conn.execute(
                f"SELECT count(*), count(DISTINCT n), min(n), max(r), CAST(group_concat(l, char(10)) AS BLOB) "
                f"FROM (SELECT rowid AS r, {node_expr} AS n, {line} AS l FROM {window})",
                (after, self.batch_rows),
            ).fetchone()
            if not n:
                return None
            if nodes == 1:
                return _Batch(int(last), body + b"\n", node or self.node, int(n))
        rows = conn.execute(
            f"SELECT rowid, {node_expr}, {time_expr}, CAST({line} AS BLOB) FROM {window}", (after, self.batch_rows)
        ).fetchall()
        if not rows:
            return None
        first_node = rows[0][1]
        lines: list[bytes] = []
        last = after
        for rowid, node, t, text in rows:  # cut where the node changes, or at the first row still open
            if node != first_node or (closed_before is not None and t is not None and t >= closed_before):
                break
            lines.append(text)
            last = rowid
        if not lines:
            return None
        return _Batch(last, b"\n".join(lines) + b"\n", first_node or self.node, len(lines))

    def _check_cursor(self, table: Table) -> None:
        """A table emptied (the disk budget pruned every row) numbers its next rows from 1 again, below the
        cursor: start over from the first row (rows sent again collapse by identity in the store)."""
        top = self.conn.execute(f"SELECT max(rowid) FROM {table.name}").fetchone()[0]
        shipped = self._progress(table.name)[0]
        if shipped != FIRST_ROWID and (top is None or top < shipped):
            self.conn.execute(
                "UPDATE clickhouse_progress SET shipped = ? WHERE target = ? AND tbl = ?",
                (FIRST_ROWID, self.target, table.name),
            )

    def _reader(self) -> sqlite3.Connection:
        if self._read_conn is None:
            self._read_conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        return self._read_conn

    def _key_of(self, table: Table, rowid: int, node: str) -> str:
        cols = [k for k in table.key if k != "node"]
        row = self.conn.execute(f"SELECT {', '.join(cols)} FROM {table.name} WHERE rowid = ?", (rowid,)).fetchone()
        return json.dumps({"node": node, **dict(zip(cols, row, strict=True))})

    def _landed(self, table: Table, key: str) -> bool:
        where = " AND ".join(f"`{k}` = {ch_literal(v)}" for k, v in json.loads(key).items())
        res = self.ch.select(f"SELECT count() FROM {self.database}.{table.name} WHERE {where}")
        return bool(res.rows and int(res.rows[0][0]) > 0)

    def _closed_before(self, table: Table) -> int | None:
        """Rows of a table updated in place are shipped once their time is past updating."""
        if table.closed_after_ns is None or not is_live(self.conn):
            return None
        return now_ns() - table.closed_after_ns

    # --- shipping -------------------------------------------------------------------------------

    def _ship_keyed(self, table: Table, names: list[str], parts: list[str], prog: TableProgress) -> None:
        """Send the rows whose identity (and version) the store lacks: exact after any crash, no progress kept."""
        (key,) = (k for k in table.key if k != "node")
        node_expr = '"node"' if "node" in self._sqlite_columns(table) else _sql_text_literal(self.node)
        ver = f'"{table.version}"' if table.version else "0"
        fingerprint = self.conn.execute(f"SELECT count(*), total(rowid), total({ver}) FROM {table.name}").fetchone()
        if self._keyed_seen.get(table.name) == fingerprint:
            return  # unchanged since it was last found complete in the store
        line = _line_sql(parts)
        rows = self.conn.execute(
            f'SELECT {node_expr}, "{key}", {ver}, CAST({line} AS BLOB) FROM {table.name} ORDER BY rowid'
        ).fetchall()
        if not rows:
            return
        nodes = ", ".join(sorted({ch_literal(r[0]) for r in rows}))
        ver_ch = f"`{table.version}`" if table.version else "0"
        stored = self.ch.select(
            f"SELECT node, `{key}`, {ver_ch} FROM {self.database}.{table.name} WHERE node IN ({nodes})"
        ).rows
        have = {(n, k, v) for n, k, v in stored}
        missing = [text for n, k, v, text in rows if (n, k, v) not in have]
        for at in range(0, len(missing), self.batch_rows):
            chunk = missing[at : at + self.batch_rows]
            self.ch.insert(f"{self.database}.{table.name}", tuple(names), b"\n".join(chunk) + b"\n", INSERT_SETTINGS)
            prog.rows += len(chunk)
            prog.batches += 1
        self._keyed_seen[table.name] = fingerprint
        if missing:
            self.conn.execute(
                "INSERT INTO clickhouse_progress(target, tbl, shipped, rows, updated_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(target, tbl) DO UPDATE SET rows = rows + excluded.rows, updated_at = excluded.updated_at",
                (self.target, table.name, FIRST_ROWID, len(missing), now_ns()),
            )

    def ship_table(self, table: Table, *, max_batches: int | None = None) -> TableProgress:
        prog = TableProgress(table.name)
        if table.name not in self._have:
            return prog
        try:
            names, parts = self._columns(table)
            if table.keyed:
                self._ship_keyed(table, names, parts, prog)
                return prog
            _, pending, pending_key, _ = self._progress(table.name)
            if pending is not None and pending_key is not None:
                landed = self._landed(table, pending_key)
                self._settle(table.name, landed)
                prog.settled += landed
                prog.resent += not landed
            self._check_cursor(table)
            closed_before = self._closed_before(table)
            dest = f"{self.database}.{table.name}"
            # the next batch is read (over a second connection) while the current one is being inserted
            read = partial(self._read, self._reader(), table, parts=parts, closed_before=closed_before)
            with ThreadPoolExecutor(1, thread_name_prefix="ingero-ship-read") as pool:
                ahead = pool.submit(read, after=self._progress(table.name)[0])
                while True:
                    batch = ahead.result()
                    if batch is None:
                        break
                    prog.batches += 1
                    if max_batches is None or prog.batches < max_batches:
                        ahead = pool.submit(read, after=batch.last_rowid)
                    self._send(table, dest, names, batch)
                    prog.rows += batch.rows
                    if max_batches is not None and prog.batches >= max_batches:
                        break
        except sqlite3.Error as e:
            raise translate(e, self.path) from None
        return prog

    def _send(self, table: Table, dest: str, names: list[str], batch: _Batch) -> None:
        """Pending first, then the insert, then shipped: a crash anywhere leaves a state the next run settles."""
        key = self._key_of(table, batch.last_rowid, batch.node)
        self._set_pending(table.name, batch.last_rowid, key, batch.rows)
        self.ch.insert(dest, tuple(names), batch.body, INSERT_SETTINGS)
        self._settle(table.name, True)

    def ship_once(self, *, max_batches: int | None = None) -> ShipResult:
        """Ship every table's rows not yet shipped (up to ``max_batches`` per table)."""
        started = time.perf_counter()
        result = ShipResult()
        try:
            self._look()
        except sqlite3.Error as e:
            raise translate(e, self.path) from None
        if "events" not in self._have:  # a tracer that has not created its schema yet
            return result
        for table in self.tables:
            result.tables[table.name] = self.ship_table(table, max_batches=max_batches)
        result.elapsed_s = time.perf_counter() - started
        self.last_error = None
        self.last_ok_ns = now_ns()
        return result

    def follow(
        self,
        stop: threading.Event,
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        on_round: Callable[[ShipResult | None, str | None], None] | None = None,
    ) -> None:
        """Ship until ``stop`` is set: every ``interval_s``; while the cluster is down, back off
        (doubling up to ``max_backoff_s``) and resume from the progress when it is back."""
        wait = interval_s
        while not stop.is_set():
            try:
                res: ShipResult | None = self.ship_once()
                wait = interval_s
                err = None
            except ClickHouseUnavailableError as e:
                res, err = None, e.one_line()
                self.last_error = err
                wait = min(max(wait, interval_s) * 2, max_backoff_s)
            if on_round is not None:
                on_round(res, err)
            stop.wait(wait)


class BackgroundShipping:
    """Ships a recording from a daemon thread while it is being written (``ingero trace --clickhouse``).

    The thread waits for the database to appear, then follows it (:meth:`Shipper.follow`); :meth:`stop` ends
    the loop after one last round (best effort: what is left is shipped by the next ``ingero ship``)."""

    def __init__(
        self,
        db: str | Path,
        connect: Callable[[], ClickHouse],
        *,
        interval_s: float = 1.0,
        on_round: Callable[[ShipResult | None, str | None], None] | None = None,
        **shipper_kw: Any,
    ) -> None:
        self.db = Path(db)
        self._connect = connect
        self._interval = interval_s
        self._on_round = on_round
        self._kw = shipper_kw
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingero-clickhouse-shipper", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> BackgroundShipping:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self.db.exists():
            if self._stop.wait(self._interval):
                return
        ch = self._connect()
        try:
            with Shipper(self.db, ch, **self._kw) as shipper:
                shipper.follow(self._stop, interval_s=self._interval, on_round=self._on_round)
                with contextlib.suppress(ClickHouseUnavailableError):
                    shipper.ship_once()
        except Exception as e:  # the recording goes on; the caller reports it after stop()
            self.error = e
        finally:
            ch.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
