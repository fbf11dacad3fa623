"""Database schema: Ingero's layout (schema_info version 0.9) plus ingero's additions, and migrations.

Compatibility rules
* Every table and column of Ingero's databases exists here with the same name, type and meaning,
  so SQL written for their schema runs unchanged on ours (and vice versa for the common part).
* Our own additions are new tables (``node_seq``, ``nccl_comms``, ``session_stats``), new
  source/op rows on ids Ingero does not use (NCCL = source 9: Ingero's 8 is CUDA Graph events), and
  (schema 2) a ``node`` column on ``system_snapshots`` so snapshots stay attributable after databases
  are merged.
* Schema 3 (collectives): NCCL moves from source 8 to 9 (rows of our older databases are rewritten;
  an Ingero database's source-8 rows are CUDA Graph events and stay); ``nccl_comms`` gains
  ``comm_id``; and ``nccl_calls`` holds one row per NCCL collective or point-to-point call:

  ``nccl_comms(comm, pid, rank, nranks, node, seen_at, comm_id)`` — one row per communicator a
  process created. ``comm`` is the local ``ncclComm_t`` pointer (``events.arg1`` of NCCL rows,
  ``nccl_calls.comm``), ``comm_id`` the cluster-wide id: splitmix64 folded over the 16 little-endian
  64-bit words of the full 128-byte ``ncclUniqueId`` passed to ``ncclCommInitRank[Config]``
  (:func:`ingero.store.catalog.nccl_comm_id`; the first 8 bytes alone collide across jobs), stored as
  a signed 64-bit integer; 0 when unknown (``ncclCommInitAll``, or a communicator created before
  tracing started).

  ``nccl_calls(node, pid, tid, comm, seq, op, timestamp, duration, datatype, redop, count, bytes,
  peer, ret_code)`` — ``comm`` the local pointer (join ``nccl_comms`` on node, pid, comm for the
  cluster-wide id and the rank), ``seq`` the k-th call on that communicator in that process since
  tracing started (0-based; the same k on every rank is the same collective), ``op`` the NCCL op id,
  ``timestamp`` the entry (Unix ns), ``duration`` ns (−1: entered, not returned when recorded),
  ``datatype`` the ``ncclDataType_t``, ``redop`` the ``ncclRedOp_t`` (−1 where the call has none),
  ``count`` elements, ``bytes`` = count × the datatype's size, ``peer`` the peer rank of
  ``ncclSend``/``ncclRecv`` and the root of ``ncclBroadcast``/``ncclReduce`` (−1 otherwise).
* Schema 6: ``event_aggregates.node`` (appended to Ingero's columns, and in the primary key): whose
  minute counts a row holds, so a merged cluster database keeps each node's storage regime apart.
* Our schema version lives in ``PRAGMA user_version`` (Ingero leaves it at 0). ``migrate()``
  brings any older layout we can write to ``SCHEMA_VERSION``; a database with a newer version is
  refused by every reader and writer (:class:`~ingero.errors.SchemaTooNewError`).
* Ingero 0.8 databases (``events.id INTEGER``, no ``node`` column) open read-only only.

One deliberate difference: ``events`` is append-optimised. Ingero declares ``id TEXT PRIMARY KEY``
and indexes ``pid``, ``(source, op, stack_hash)`` and ``cgroup_id``; on this machine SQLite alone then
inserts at most ~180-200 k realistic rows/s (measured in ``bench/bench_writer.py``), below the
writer's 300 k/s target. Every reader here is time-windowed, so new databases keep only the
timestamp index; ``id`` keeps its column, type and ``{node}:{seq}`` format and stays unique by
construction (the writer allocates ``seq`` from ``node_seq`` inside each write transaction).
Ad-hoc filters on pid/op/stack scan the time window instead of an index. Ingero databases we open or
append to keep whatever indexes they have.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from ingero import __version__
from ingero.errors import SchemaError, SchemaTooNewError
from ingero.store.catalog import NCCL, OPS, SOURCES
from ingero.timeutil import NS_PER_S

AGGREGATE_BUCKET_NS = 60 * NS_PER_S  # event_aggregates.bucket: one row per minute (Ingero's layout)

SCHEMA_VERSION = 6
INGERO_LAYOUT = "0.9"

# Ingero's DDL, column for column (comments kept: they are what `.schema` shows users), with the
# events table append-optimised as the module docstring explains.
INGERO_TABLES = """
CREATE TABLE IF NOT EXISTS events (
	id         TEXT NOT NULL,          -- "{node}:{seq}" node-namespaced ID (unique by construction)
	timestamp  INTEGER NOT NULL,       -- unix nanos
	pid        INTEGER NOT NULL,
	tid        INTEGER NOT NULL,
	source     INTEGER NOT NULL,
	op         INTEGER NOT NULL,
	duration   INTEGER NOT NULL,       -- nanos
	gpu_id     INTEGER NOT NULL DEFAULT 0,
	arg0       INTEGER NOT NULL DEFAULT 0,
	arg1       INTEGER NOT NULL DEFAULT 0,
	ret_code   INTEGER NOT NULL DEFAULT 0,
	stack_hash INTEGER NOT NULL DEFAULT 0, -- FK to stack_traces.hash (0 = no stack)
	node       TEXT NOT NULL DEFAULT '',
	rank       INTEGER,
	local_rank INTEGER,
	world_size INTEGER,
	stack_ips  TEXT NOT NULL DEFAULT '',
	cgroup_id  INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_events_timestamp ON events(timestamp);
CREATE TABLE IF NOT EXISTS stack_traces (
	hash   INTEGER PRIMARY KEY,  -- FNV-64 of raw IP bytes (no AUTOINCREMENT needed)
	ips    TEXT    NOT NULL,      -- JSON array of hex IPs: ["0x7f1234","0x7f5678"]
	frames TEXT    NOT NULL DEFAULT ''  -- resolved symbols JSON (compact): [{"s":"cudaMalloc","f":"libcudart.so"}]
);
CREATE TABLE IF NOT EXISTS causal_chains (
	id              TEXT PRIMARY KEY,       -- "{node}:{descriptor}" node-namespaced ID
	detected_at     INTEGER NOT NULL,       -- unix nanos (when chain was detected)
	severity        TEXT NOT NULL,           -- HIGH, MEDIUM, LOW
	summary         TEXT NOT NULL,           -- one-line description
	root_cause      TEXT NOT NULL,           -- human-readable root cause
	explanation     TEXT NOT NULL,           -- paragraph explaining the chain
	recommendations TEXT NOT NULL DEFAULT '',-- JSON array of strings
	cuda_op         TEXT NOT NULL DEFAULT '',-- affected CUDA/driver op
	cuda_p99_us     INTEGER NOT NULL DEFAULT 0,
	cuda_p50_us     INTEGER NOT NULL DEFAULT 0,
	tail_ratio      REAL NOT NULL DEFAULT 0,
	timeline        TEXT NOT NULL DEFAULT '',-- JSON array of timeline events
	node            TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS idx_chains_detected_at ON causal_chains(detected_at);
CREATE INDEX IF NOT EXISTS idx_chains_severity ON causal_chains(severity);
CREATE TABLE IF NOT EXISTS sources (
	id          INTEGER PRIMARY KEY,
	name        TEXT NOT NULL,
	description TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ops (
	source_id   INTEGER NOT NULL,
	op_id       INTEGER NOT NULL,
	name        TEXT NOT NULL,
	description TEXT NOT NULL,
	PRIMARY KEY (source_id, op_id)
);
CREATE TABLE IF NOT EXISTS schema_info (
	key   TEXT PRIMARY KEY,
	value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS system_snapshots (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	timestamp  INTEGER NOT NULL UNIQUE,  -- unix nanos (unique prevents duplicates)
	cpu_pct    REAL    NOT NULL,  -- CPU utilization %
	mem_pct    REAL    NOT NULL,  -- memory used %
	mem_avail  INTEGER NOT NULL,  -- available MB
	swap_mb    INTEGER NOT NULL,  -- swap used MB
	load_avg   REAL    NOT NULL   -- 1-minute load average
);
CREATE UNIQUE INDEX IF NOT EXISTS idx_snapshots_ts_uniq ON system_snapshots(timestamp);
CREATE TABLE IF NOT EXISTS sessions (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	started_at INTEGER NOT NULL,
	stopped_at INTEGER NOT NULL DEFAULT 0,
	gpu_model  TEXT NOT NULL DEFAULT '',
	gpu_driver TEXT NOT NULL DEFAULT '',
	cpu_model  TEXT NOT NULL DEFAULT '',
	cpu_cores  INTEGER NOT NULL DEFAULT 0,
	mem_total  INTEGER NOT NULL DEFAULT 0,
	kernel     TEXT NOT NULL DEFAULT '',
	os_release TEXT NOT NULL DEFAULT '',
	cuda_ver   TEXT NOT NULL DEFAULT '',
	python_ver TEXT NOT NULL DEFAULT '',
	ingero_ver TEXT NOT NULL DEFAULT '',
	pid_filter TEXT NOT NULL DEFAULT '',
	flags      TEXT NOT NULL DEFAULT '',
	node       TEXT NOT NULL DEFAULT '',
	rank       INTEGER,
	local_rank INTEGER,
	world_size INTEGER
);
CREATE INDEX IF NOT EXISTS idx_sessions_started ON sessions(started_at);
CREATE TABLE IF NOT EXISTS process_names (
	pid     INTEGER NOT NULL,
	name    TEXT NOT NULL,
	seen_at INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (pid)
);
CREATE TABLE IF NOT EXISTS event_aggregates (
	bucket    INTEGER NOT NULL,  -- minute-truncated unix nanos
	source    INTEGER NOT NULL,
	op        INTEGER NOT NULL,
	pid       INTEGER NOT NULL DEFAULT 0,
	count     INTEGER NOT NULL DEFAULT 0,
	stored    INTEGER NOT NULL DEFAULT 0,
	sum_dur   INTEGER NOT NULL DEFAULT 0,
	min_dur   INTEGER NOT NULL DEFAULT 0,
	max_dur   INTEGER NOT NULL DEFAULT 0,
	sum_arg0  INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (bucket, source, op, pid)
);
CREATE INDEX IF NOT EXISTS idx_aggregates_bucket ON event_aggregates(bucket);
CREATE TABLE IF NOT EXISTS cgroup_metadata (
	cgroup_id    INTEGER PRIMARY KEY,  -- bpf_get_current_cgroup_id() value
	container_id TEXT NOT NULL DEFAULT '',  -- 64-char hex container ID
	cgroup_path  TEXT NOT NULL DEFAULT '',  -- raw cgroup path from /proc/[pid]/cgroup
	pod_name     TEXT NOT NULL DEFAULT '',  -- K8s pod name (empty on bare metal)
	namespace    TEXT NOT NULL DEFAULT ''   -- K8s namespace (empty on bare metal)
);
CREATE INDEX IF NOT EXISTS idx_cgroup_metadata_container_id ON cgroup_metadata(container_id)
	WHERE container_id != '';
CREATE TABLE IF NOT EXISTS cgroup_schedstat (
	cgroup_id     INTEGER NOT NULL,
	p99_off_cpu   INTEGER NOT NULL,  -- p99 off-CPU duration (nanos)
	total_off_cpu INTEGER NOT NULL,  -- total off-CPU duration (nanos)
	event_count   INTEGER NOT NULL,
	window_start  INTEGER NOT NULL DEFAULT 0,  -- unix nanos
	window_end    INTEGER NOT NULL DEFAULT 0,  -- unix nanos
	PRIMARY KEY (cgroup_id, window_end)
);
CREATE INDEX IF NOT EXISTS idx_cgroup_schedstat_cgroup ON cgroup_schedstat(cgroup_id);
"""

# ingero's own tables (schema 1).
INGERO_PY_TABLES = """
CREATE TABLE IF NOT EXISTS node_seq (
	node     TEXT PRIMARY KEY,        -- node name
	next_seq INTEGER NOT NULL         -- next free {seq} for ids "{node}:{seq}" (survives restarts)
);
CREATE TABLE IF NOT EXISTS nccl_comms (
	comm    INTEGER NOT NULL,         -- ncclComm_t pointer value (events.arg1 of NCCL rows)
	pid     INTEGER NOT NULL,
	rank    INTEGER NOT NULL,         -- rank inside this communicator
	nranks  INTEGER NOT NULL,
	node    TEXT NOT NULL DEFAULT '',
	seen_at INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (node, pid, comm)
);
CREATE TABLE IF NOT EXISTS session_stats (
	session_id INTEGER NOT NULL,      -- sessions.id
	key        TEXT NOT NULL,         -- e.g. events_seen, events_stored, events_dropped_ring
	value      INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (session_id, key)
);
"""

SCHEMA_NOTES: dict[str, str] = {
    "timestamp_unit": "nanoseconds (Unix epoch)",
    "duration_unit": "nanoseconds",
    "arg0_note": "Operation-specific: byte size for alloc/memcpy/NCCL, kernel function pointer for launch",
    "arg1_note": "Operation-specific: memcpy direction for cudaMemcpy/cudaMemcpyAsync, communicator for NCCL",
    "ret_code_note": "CUDA/NCCL return code (0 = success). Host events always 0.",
    "node_note": "Node identity for multi-node correlation. events.id format: {node}:{seq}. "
    "causal_chains.id format: {node}:{descriptor}.",
    "version": INGERO_LAYOUT,
    "ingero_py_schema": str(SCHEMA_VERSION),
}


@dataclass(frozen=True)
class Layout:
    """What kind of database a file holds."""

    kind: str  # "empty" | "ingero-py" | "ingero-0.9" | "ingero-0.8"
    user_version: int
    has_node: bool
    text_ids: bool

    @property
    def writable_by_us(self) -> bool:
        return self.kind in ("empty", "ingero-py", "ingero-0.9")


def inspect_layout(conn: sqlite3.Connection) -> Layout:
    """Classify an open database. Raises SchemaTooNewError / SchemaError."""
    user_version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if user_version > SCHEMA_VERSION:
        raise SchemaTooNewError(
            f"database schema version {user_version} is newer than this ingero understands (up to {SCHEMA_VERSION})",
            hint=f"upgrade ingero (this is {__version__}) or open it with the version that wrote it",
        )
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return Layout("empty", user_version, has_node=True, text_ids=True)
    if "events" not in tables:
        raise SchemaError(
            "not an ingero database: it has no 'events' table",
            hint="point --db at a database written by ingero or Ingero",
        )
    cols = {r[1]: (r[2] or "").upper() for r in conn.execute("PRAGMA table_info(events)")}
    missing = {"timestamp", "pid", "tid", "source", "op", "duration"} - set(cols)
    if missing:
        raise SchemaError(f"'events' table lacks column(s) {', '.join(sorted(missing))}")
    has_node = "node" in cols
    text_ids = cols.get("id", "") == "TEXT"
    if user_version >= 1:
        kind = "ingero-py"
    elif has_node and text_ids:
        kind = "ingero-0.9"
    else:
        kind = "ingero-0.8"
    return Layout(kind, user_version, has_node, text_ids)


def _exec_script(conn: sqlite3.Connection, script: str) -> None:
    """Run a DDL script statement by statement, inside the caller's transaction.

    (``executescript`` would COMMIT first and break the migration's atomicity.)
    """
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            conn.execute(buf)
            buf = ""
    if buf.strip():
        raise ValueError(f"incomplete DDL statement: {buf[:60]!r}")


def _migrate_to_1(conn: sqlite3.Connection) -> None:
    """Empty file or Ingero 0.9 → ingero schema 1."""
    _exec_script(conn, INGERO_TABLES)
    # Ingero 0.9 databases created before stack_ips/cgroup_id existed add them by ALTER TABLE.
    cols = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    if "stack_ips" not in cols:
        conn.execute("ALTER TABLE events ADD COLUMN stack_ips TEXT NOT NULL DEFAULT ''")
    if "cgroup_id" not in cols:
        conn.execute("ALTER TABLE events ADD COLUMN cgroup_id INTEGER NOT NULL DEFAULT 0")
    _exec_script(conn, INGERO_PY_TABLES)
    conn.executemany("INSERT OR IGNORE INTO sources(id, name, description) VALUES (?, ?, ?)", SOURCES)
    conn.executemany("INSERT OR IGNORE INTO ops(source_id, op_id, name, description) VALUES (?, ?, ?, ?)", OPS)


NCCL_CALLS_TABLE = """
CREATE TABLE IF NOT EXISTS nccl_calls (
	node      TEXT NOT NULL DEFAULT '',
	pid       INTEGER NOT NULL,
	tid       INTEGER NOT NULL,
	comm      INTEGER NOT NULL,            -- local ncclComm_t pointer (nccl_comms.comm)
	seq       INTEGER NOT NULL,            -- k-th call on this communicator in this process (0-based)
	op        INTEGER NOT NULL,            -- ops.op_id of the NCCL source
	timestamp INTEGER NOT NULL,            -- entry, unix nanos
	duration  INTEGER NOT NULL,            -- nanos; -1: had not returned when recorded
	datatype  INTEGER NOT NULL DEFAULT -1, -- ncclDataType_t
	redop     INTEGER NOT NULL DEFAULT -1, -- ncclRedOp_t (-1: none)
	count     INTEGER NOT NULL DEFAULT 0,  -- elements
	bytes     INTEGER NOT NULL DEFAULT 0,
	peer      INTEGER NOT NULL DEFAULT -1, -- send/recv peer, broadcast/reduce root (-1: none)
	ret_code  INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_nccl_calls_timestamp ON nccl_calls(timestamp);
CREATE UNIQUE INDEX IF NOT EXISTS idx_nccl_calls_call ON nccl_calls(node, pid, tid, timestamp);
"""


def _single_node(conn: sqlite3.Connection) -> str | None:
    """The one node a database being migrated holds (its sessions, else its events); None for none or several."""
    nodes = [r[0] for r in conn.execute("SELECT DISTINCT node FROM sessions WHERE node != ''")]
    if not nodes:
        nodes = [r[0] for r in conn.execute("SELECT DISTINCT node FROM events WHERE node != '' LIMIT 2")]
    return nodes[0] if len(nodes) == 1 else None


def _migrate_to_2(conn: sqlite3.Connection) -> None:
    """Schema 2: ``system_snapshots.node``; existing snapshots of a one-node database become its own."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(system_snapshots)")}
    if "node" not in cols:
        conn.execute("ALTER TABLE system_snapshots ADD COLUMN node TEXT NOT NULL DEFAULT ''")
    node = _single_node(conn)
    if node is not None:
        conn.execute("UPDATE system_snapshots SET node = ? WHERE node = ''", (node,))


def _migrate_to_3(conn: sqlite3.Connection) -> None:
    """Schema 3: NCCL off source 8 (Ingero's CUDA Graph id) onto 9, ``nccl_comms.comm_id``, ``nccl_calls``.

    Rows move only where this database's own ``sources`` row 8 says NCCL (our schema 1-2): in an
    Ingero database source 8 is CUDA Graph events and stays."""
    row = conn.execute("SELECT name FROM sources WHERE id = 8").fetchone()
    if row is not None and row[0] == "NCCL":
        for table, col in (("events", "source"), ("event_aggregates", "source"), ("ops", "source_id")):
            conn.execute(f"UPDATE {table} SET {col} = ? WHERE {col} = 8", (NCCL,))
        conn.execute("DELETE FROM sources WHERE id = 8")
    conn.executemany("INSERT OR IGNORE INTO sources(id, name, description) VALUES (?, ?, ?)", SOURCES)
    conn.executemany("INSERT OR IGNORE INTO ops(source_id, op_id, name, description) VALUES (?, ?, ?, ?)", OPS)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(nccl_comms)")}
    if "comm_id" not in cols:
        conn.execute("ALTER TABLE nccl_comms ADD COLUMN comm_id INTEGER NOT NULL DEFAULT 0")
    _exec_script(conn, NCCL_CALLS_TABLE)


ANNOTATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS annotations (  -- Ingero's layout (agent 0.17), plus node
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	timestamp  INTEGER NOT NULL,            -- unix nanos (annotation instant)
	labels     TEXT    NOT NULL,            -- JSON object of key/value strings (ingero annotate: message, author)
	pid        INTEGER NOT NULL DEFAULT 0,  -- process scope (0 = unscoped)
	start_time INTEGER NOT NULL DEFAULT 0,  -- /proc/<pid>/stat field 22 (incarnation key)
	span_start INTEGER NOT NULL DEFAULT 0,  -- unix nanos (0 = instant, not a span)
	span_end   INTEGER NOT NULL DEFAULT 0,  -- unix nanos
	peer_uid   INTEGER NOT NULL DEFAULT 0,  -- uid of the writer
	peer_gid   INTEGER NOT NULL DEFAULT 0,  -- gid of the writer
	peer_pid   INTEGER NOT NULL DEFAULT 0,  -- pid of the writer
	node       TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS idx_annotations_timestamp ON annotations(timestamp);
"""


def _migrate_to_4(conn: sqlite3.Connection) -> None:
    """Schema 4: ``annotations`` (``ingero annotate``), ``cgroup_metadata.job_id`` (Slurm job) and
    ``cgroup_metadata.seen_at``."""
    _exec_script(conn, ANNOTATIONS_TABLE)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(cgroup_metadata)")}
    if "job_id" not in cols:
        conn.execute("ALTER TABLE cgroup_metadata ADD COLUMN job_id TEXT NOT NULL DEFAULT ''")
    if "seen_at" not in cols:
        conn.execute("ALTER TABLE cgroup_metadata ADD COLUMN seen_at INTEGER NOT NULL DEFAULT 0")


def _migrate_to_5(conn: sqlite3.Connection) -> None:
    """Schema 5: ``engine_metrics`` (``ingero trace --inference``: serving engines' own series)."""
    from ingero.store.engine_metrics import TABLE_SQL

    _exec_script(conn, TABLE_SQL)


# event_aggregates from schema 6: Ingero's columns in Ingero's order, then the node that counted the row,
# which joins the primary key (two nodes count the same minute, op and pid in a merged database).
AGGREGATE_KEY = ("bucket", "source", "op", "pid", "node")
# Ingero's columns of a row (what a recorder's aggregate tuple holds, in this order); ``node`` is the writer's
AGGREGATE_COLUMNS = ("bucket", "source", "op", "pid", "count", "stored", "sum_dur", "min_dur", "max_dur", "sum_arg0")
_INGERO_AGGREGATE_KEY = "\tPRIMARY KEY (bucket, source, op, pid)\n"


def _aggregates_table() -> str:
    """The schema-6 ``event_aggregates`` DDL: Ingero's (from :data:`INGERO_TABLES`, declared there once)
    with ``node`` added and in the key."""
    start = INGERO_TABLES.index("CREATE TABLE IF NOT EXISTS event_aggregates (")
    end = INGERO_TABLES.index("\n);", start) + 4
    index = INGERO_TABLES.index("CREATE INDEX IF NOT EXISTS idx_aggregates_bucket")
    ddl = INGERO_TABLES[start:end] + INGERO_TABLES[index : INGERO_TABLES.index("\n", index) + 1]
    if ddl.count(_INGERO_AGGREGATE_KEY) != 1:
        raise AssertionError("Ingero's event_aggregates DDL changed: update _aggregates_table")
    node = "\tnode      TEXT    NOT NULL DEFAULT '',  -- the node that counted them ('' = unknown: an older merge)\n"
    return ddl.replace(_INGERO_AGGREGATE_KEY, f"{node}\tPRIMARY KEY ({', '.join(AGGREGATE_KEY)})\n")


AGGREGATES_TABLE = _aggregates_table()
# Counts of one key written again (the writer's next flush of an open minute; a merge of a rotated database)
# add up: the upsert every writer of event_aggregates ends its INSERT with.
AGGREGATES_UPSERT = (
    f"ON CONFLICT({', '.join(AGGREGATE_KEY)}) DO UPDATE SET count = count + excluded.count, "
    "stored = stored + excluded.stored, sum_dur = sum_dur + excluded.sum_dur, "
    "min_dur = min(min_dur, excluded.min_dur), max_dur = max(max_dur, excluded.max_dur), "
    "sum_arg0 = sum_arg0 + excluded.sum_arg0"
)


def _migrate_to_6(conn: sqlite3.Connection) -> None:
    """Schema 6: ``event_aggregates.node``, in the primary key (SQLite cannot change a key in place: the
    table is rebuilt, its rows kept). The rows of a one-node database become its own; those of a database
    holding several (an older ``ingero merge``: cluster totals) keep ``''``, attributable to no node."""
    cols = [r[1] for r in conn.execute("PRAGMA table_info(event_aggregates)")]
    if "node" in cols:
        return
    kept = ", ".join(c for c in cols if c != "node")
    conn.execute("DROP INDEX IF EXISTS idx_aggregates_bucket")
    conn.execute("ALTER TABLE event_aggregates RENAME TO event_aggregates_schema5")
    _exec_script(conn, AGGREGATES_TABLE)
    conn.execute(
        f"INSERT INTO event_aggregates({kept}, node) SELECT {kept}, ? FROM event_aggregates_schema5",
        (_single_node(conn) or "",),
    )
    conn.execute("DROP TABLE event_aggregates_schema5")


# MIGRATIONS[i] takes user_version i to i + 1.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _migrate_to_1,
    _migrate_to_2,
    _migrate_to_3,
    _migrate_to_4,
    _migrate_to_5,
    _migrate_to_6,
]
assert len(MIGRATIONS) == SCHEMA_VERSION


def _add_catalog_rows(conn: sqlite3.Connection) -> None:
    """The ``sources``/``ops`` rows a newer ingero added to the catalog (new ops need no schema
    change), in a database already at :data:`SCHEMA_VERSION`; writes only when some are missing."""
    have = set(conn.execute("SELECT source_id, op_id FROM ops").fetchall())
    have_src = {r[0] for r in conn.execute("SELECT id FROM sources")}
    if all((s, o) in have for s, o, _, _ in OPS) and all(sid in have_src for sid, _, _ in SOURCES):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany("INSERT OR IGNORE INTO sources(id, name, description) VALUES (?, ?, ?)", SOURCES)
        conn.executemany("INSERT OR IGNORE INTO ops(source_id, op_id, name, description) VALUES (?, ?, ?, ?)", OPS)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def migrate(conn: sqlite3.Connection) -> Layout:
    """Create or upgrade the schema in place (one transaction). Returns the final layout."""
    layout = inspect_layout(conn)
    if not layout.writable_by_us:
        raise SchemaError(
            "this is an Ingero 0.8-layout database (integer ids, no node column); ingero opens it read-only",
            hint="convert it with: ingero merge OLD.db --force-node NAME -o NEW.db",
        )
    if layout.user_version == SCHEMA_VERSION:
        _add_catalog_rows(conn)
        return layout
    conn.execute("BEGIN IMMEDIATE")
    try:
        for step in MIGRATIONS[layout.user_version :]:
            step(conn)
        conn.executemany("INSERT OR REPLACE INTO schema_info(key, value) VALUES (?, ?)", SCHEMA_NOTES.items())
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return inspect_layout(conn)
