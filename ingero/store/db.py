"""Opening databases: read-only for every reader, writable for the one writer.

* :func:`open_readonly` never changes the file or leaves anything beside it: a database with no
  ``-wal`` file (a finished recording, a shipped sample on a read-only disk) is opened
  ``immutable``; a live one (its writer holds a ``-wal``) is opened ``mode=ro``.
  Ingero 0.8 layouts (no ``node`` column) get TEMP views that add ``node``/``rank``/... so that
  fleet SQL such as ``SELECT node, ... FROM events`` runs on them unchanged.
* :func:`open_writable` creates or migrates the schema, turns on WAL and the writer's pragmas;
  :func:`write_transaction` is one ``BEGIN IMMEDIATE`` transaction on such a connection.

sqlite3 errors are translated to :mod:`ingero.errors` here, once, by ``sqlite_errorname``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import DatabaseNotFoundError, DiskFullError, NotADatabaseError, StoreError
from ingero.store.budget import errorname
from ingero.store.instance import ensure_instance_id
from ingero.store.schema import Layout, inspect_layout, migrate
from ingero.timeutil import NS_PER_S, now_ns

# A session with stopped_at = 0 counts as live only if something was recorded this recently.
LIVE_WINDOW_NS = 120 * NS_PER_S


def _uri(path: Path, **params: str) -> str:
    query = urllib.parse.urlencode(params)
    return f"file:{urllib.parse.quote(str(path.resolve()))}?{query}"


def _check_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise DatabaseNotFoundError(f"{p}: no such database file", hint="check the path")
    if p.is_dir():
        raise NotADatabaseError(f"{p} is a directory, not a database file")
    return p


def is_disk_full(e: sqlite3.Error) -> bool:
    """SQLITE_FULL, or the WAL index (``-shm``) that could not grow: what a full disk looks like."""
    return errorname(e) == "SQLITE_FULL" or getattr(e, "sqlite_errorname", "") == "SQLITE_IOERR_SHMSIZE"


def translate(e: sqlite3.Error, path: str | Path) -> StoreError:
    """sqlite3 error → one-line StoreError naming the file, classified by SQLite's error name (a full disk
    is a :class:`~ingero.errors.DiskFullError` for every writer: tracer, merge, annotate, export)."""
    name = errorname(e)
    if is_disk_full(e):
        return DiskFullError(f"the disk of {path} is full", hint="free some space, or set a smaller --max-db")
    if name == "SQLITE_NOTADB":
        return NotADatabaseError(f"{path} is not a SQLite database", hint="check the path")
    if name == "SQLITE_CANTOPEN":
        return StoreError(f"cannot open {path}: {e}", hint="check the file's permissions")
    if name in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return StoreError(f"{path} is locked by another writer: {e}")
    if name == "SQLITE_READONLY":
        return StoreError(f"{path} is read-only: {e}", hint="check the file's permissions")
    return StoreError(f"{path}: {e}")


def open_readonly(
    path: str | Path,
    *,
    legacy_node: str | None = None,
    event_filter: str | None = None,
    check_same_thread: bool = True,
) -> sqlite3.Connection:
    """Open for reading only; never creates or modifies anything on disk.

    ``legacy_node`` names the node for databases without a ``node`` column (default: file stem).
    ``event_filter`` (a trusted SQL expression, e.g. from :func:`event_filter_sql`) restricts what
    ``events`` shows to every query on this connection, through a TEMP view.
    """
    p = _check_path(path)
    live = Path(str(p) + "-wal").exists()
    params = {"mode": "ro"} if live else {"mode": "ro", "immutable": "1"}
    try:
        conn = sqlite3.connect(_uri(p, **params), uri=True, isolation_level=None, check_same_thread=check_same_thread)
    except sqlite3.Error as e:
        raise translate(e, p) from None
    try:
        layout = inspect_layout(conn)
        if layout.kind == "ingero-0.8" or event_filter:
            _add_views(conn, legacy_node or p.stem, layout.kind == "ingero-0.8", event_filter)
    except sqlite3.Error as e:
        conn.close()
        raise translate(e, p) from None
    except BaseException:
        conn.close()
        raise
    return conn


_IDENTITY_COLS = ("node", "rank", "local_rank", "world_size")


def _add_views(conn: sqlite3.Connection, node: str, legacy: bool, event_filter: str | None) -> None:
    """Shadow tables with TEMP views: add ``node``/``rank``/... to Ingero 0.8 tables that lack them,
    and apply ``event_filter`` to ``events``.

    Unqualified names resolve to the temp schema first, so ``SELECT node FROM events`` works.
    """
    quoted = "'" + node.replace("'", "''") + "'"
    for table in ("events", "sessions", "causal_chains"):
        cols = [r[1] for r in conn.execute(f"PRAGMA main.table_info({table})")]
        if not cols:
            continue
        extra = []
        if legacy:
            extra = [
                f"{quoted if c == 'node' else 'NULL'} AS {c}"
                for c in _IDENTITY_COLS
                if c not in cols and (c == "node" or table != "causal_chains")
            ]
        where = f" WHERE {event_filter}" if event_filter and table == "events" else ""
        if extra or where:
            select = ", ".join(["*", *extra])
            conn.execute(f"CREATE TEMP VIEW {table} AS SELECT {select} FROM main.{table}{where}")


def event_filter_sql(
    start_ns: int | None = None,
    end_ns: int | None = None,
    pid: int | None = None,
    source_op: tuple[int, int] | None = None,
) -> str | None:
    """A WHERE expression over events built from integers only (safe to inline), or None."""
    parts = []
    if start_ns is not None:
        parts.append(f"timestamp >= {int(start_ns)}")
    if end_ns is not None:
        parts.append(f"timestamp <= {int(end_ns)}")
    if pid is not None:
        parts.append(f"pid = {int(pid)}")
    if source_op is not None:
        parts.append(f"source = {int(source_op[0])} AND op = {int(source_op[1])}")
    return " AND ".join(parts) or None


def open_writable(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) for the single writer: schema migrated, WAL, batched-insert pragmas.

    Autocheckpointing is off on this connection: :class:`~ingero.store.writer.StoreWriter` runs
    checkpoints from a second connection in a background thread so the insert path never pays
    for them.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise NotADatabaseError(f"{p} is a directory, not a database file")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(p), isolation_level=None, check_same_thread=False)
    except (OSError, sqlite3.Error) as e:
        raise StoreError(f"cannot create {p}: {e}") from None
    try:
        fresh = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        if fresh:
            conn.execute("PRAGMA page_size = 4096")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA cache_size = -65536")  # 64 MiB
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        migrate(conn)
        ensure_instance_id(conn)
    except sqlite3.Error as e:
        conn.close()
        raise translate(e, p) from None
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass(frozen=True)
class DbSummary:
    path: str
    layout: str
    schema_version: int
    events: int
    chains: int
    stacks: int
    sessions: int
    first_ns: int | None
    last_ns: int | None
    live: bool
    nodes: list[str]


@contextlib.contextmanager
def write_transaction(path: str | Path) -> Iterator[sqlite3.Connection]:
    """A connection from :func:`open_writable` inside one ``BEGIN IMMEDIATE`` transaction: committed when
    the block ends, rolled back on a sqlite3 error (raised translated), closed either way."""
    conn = open_writable(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise translate(e, path) from None
    finally:
        conn.close()


def summarize(conn: sqlite3.Connection, path: str | Path = "") -> DbSummary:
    """Counts, time range, node names, and whether a tracer is recording into it now."""
    layout: Layout = inspect_layout(conn)
    events = _scalar(conn, "SELECT count(*) FROM events")
    first, last = conn.execute("SELECT min(timestamp), max(timestamp) FROM events").fetchone()
    return DbSummary(
        path=str(path),
        layout=layout.kind,
        schema_version=layout.user_version,
        events=events,
        chains=_scalar(conn, "SELECT count(*) FROM causal_chains", missing_ok=True),
        stacks=_scalar(conn, "SELECT count(*) FROM stack_traces", missing_ok=True),
        sessions=_scalar(conn, "SELECT count(*) FROM sessions", missing_ok=True),
        first_ns=first,
        last_ns=last,
        live=is_live(conn, last),
        nodes=node_names(conn),
    )


def node_names(conn: sqlite3.Connection) -> list[str]:
    """Distinct node names, cheaply: from sessions (fall back to events when sessions are empty)."""
    try:
        names = [r[0] for r in conn.execute("SELECT DISTINCT node FROM sessions WHERE node != ''")]
        if not names:
            names = [r[0] for r in conn.execute("SELECT DISTINCT node FROM events WHERE node != ''")]
    except sqlite3.OperationalError:
        return []
    return sorted(names)


def recorded_node(conn: sqlite3.Connection) -> str | None:
    """The one node a recording was made on (its sessions, else its events); None for a database with
    no node or several (a merged cluster database)."""
    names = node_names(conn)
    return names[0] if len(names) == 1 else None


def is_live(conn: sqlite3.Connection, last_event_ns: int | None = None) -> bool:
    """True when a session is still open and something was recorded in the last two minutes."""
    try:
        open_sessions = _scalar(conn, "SELECT count(*) FROM sessions WHERE stopped_at = 0")
    except sqlite3.OperationalError:
        return False
    if not open_sessions:
        return False
    if last_event_ns is None:
        last_event_ns = conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
    last_snap = conn.execute("SELECT max(timestamp) FROM system_snapshots").fetchone()[0]
    latest = max(last_event_ns or 0, last_snap or 0)
    return latest > 0 and now_ns() - latest < LIVE_WINDOW_NS


def _scalar(conn: sqlite3.Connection, sql: str, *, missing_ok: bool = False) -> int:
    try:
        row = conn.execute(sql).fetchone()
    except sqlite3.OperationalError:
        if missing_ok:
            return 0
        raise
    return int(row[0] or 0)
