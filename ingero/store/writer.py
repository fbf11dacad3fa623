"""The single writer of a node's database.

Everything a node records goes through one :class:`StoreWriter` (one connection, one thread at a
time): events in batched transactions, stacks, aggregates, snapshots, process names, sessions and
chains. Readers never write.

Speed (``bench/bench_writer.py``): multi-row ``INSERT ... VALUES (...), (...), ...`` statements of
:data:`ROWS_PER_STATEMENT` rows whose ids are computed in SQL from one numbered base parameter
(``'node:' || (?1 + k)``), so Python only flattens the row tuples; the node identity is baked into the
statement as literals; WAL checkpoints run off the insert path, in a background thread with its own
connection. The events table is append-optimised (see :mod:`ingero.store.schema`).

One writer per database: the writer holds an exclusive ``flock`` (:mod:`ingero.store.writer_lock`)
from open to close, so a second tracer on the same file fails at once, naming the first one's pid;
read-only connections are never blocked.

Event ids are ``{node}:{seq}``. Each write transaction (``BEGIN IMMEDIATE``, so writers serialise)
reads the next ``seq`` from ``node_seq`` and stores the new one before committing: ids never repeat,
across restarts, crashes, or two writers mistakenly sharing a node name.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ingero import __version__
from ingero.errors import StoreError
from ingero.identity import Identity, validate_node_name
from ingero.store.annotations import insert_sql as annotations_insert_sql
from ingero.store.budget import errorname
from ingero.store.cgroups import INSERT_SQL as CGROUP_INSERT_SQL
from ingero.store.db import is_disk_full, open_writable, translate
from ingero.store.engine_metrics import insert_sql as engine_metrics_insert_sql
from ingero.store.schema import AGGREGATE_BUCKET_NS, AGGREGATE_COLUMNS, AGGREGATES_UPSERT
from ingero.store.writer_lock import WriterLock
from ingero.timeutil import now_ns

# Column order of an event row handed to write_batch().
EVENT_FIELDS = (
    "timestamp",
    "pid",
    "tid",
    "source",
    "op",
    "duration",
    "gpu_id",
    "arg0",
    "arg1",
    "ret_code",
    "stack_hash",
    "cgroup_id",
)
EventRow = tuple[int, int, int, int, int, int, int, int, int, int, int, int]
ROWS_PER_STATEMENT = 128
PRUNE_STEP_FRACTION = 0.02  # on a full disk, events are deleted this share at a time (small WAL)
WAL_BYTES_PER_ROW = 256  # a generous estimate of one event's WAL bytes (row + timestamp index)
FULL_DISK_ROWS_PER_TRANSACTION = 4096  # once the disk was full: smaller transactions, each checkpointed

SESSION_FIELDS = (
    "gpu_model",
    "gpu_driver",
    "cpu_model",
    "cpu_cores",
    "mem_total",
    "kernel",
    "os_release",
    "cuda_ver",
    "python_ver",
    "pid_filter",
    "flags",
)
CHAIN_FIELDS = (
    "id",
    "detected_at",
    "severity",
    "summary",
    "root_cause",
    "explanation",
    "recommendations",
    "cuda_op",
    "cuda_p99_us",
    "cuda_p50_us",
    "tail_ratio",
    "timeline",
    "node",
)


def _sql_literal(value: int | str | None) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, int):
        return str(int(value))
    return "'" + value.replace("'", "''") + "'"


CHECKPOINT_BUSY_FRAMES = 64  # WAL pages written between two checkpoints that keep the short interval
CHECKPOINT_IDLE_S = 2.0  # the longest wait between checkpoints of a quiet WAL


class _Checkpointer(threading.Thread):
    """Runs PASSIVE WAL checkpoints from its own connection, off the writer's insert path: every
    ``interval_s`` while the WAL grows by CHECKPOINT_BUSY_FRAMES or more between two, else each wait
    doubles up to CHECKPOINT_IDLE_S (an agent at rest writes a snapshot a second: a checkpoint, with
    its fsyncs, every few seconds is enough; a busy one is back to ``interval_s`` after one wait)."""

    def __init__(self, path: Path, interval_s: float) -> None:
        super().__init__(name="ingero-checkpointer", daemon=True)
        self._path = path
        self._interval = interval_s
        self._halt = threading.Event()

    def run(self) -> None:
        conn = sqlite3.connect(str(self._path), isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout = 1000")
            wait, last = self._interval, 0
            while not self._halt.wait(wait):
                try:
                    frames = int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])
                except sqlite3.Error:
                    continue  # busy: try again next tick
                fresh = frames - last if frames >= last else frames  # the WAL restarts after a full checkpoint
                last = frames
                busy = fresh >= CHECKPOINT_BUSY_FRAMES
                wait = self._interval if busy else min(2 * wait, max(self._interval, CHECKPOINT_IDLE_S))
        finally:
            conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class _Reserve:
    """``<db>.reserve``: file-system space set aside at open and given back when the disk is full,
    so that the database can still checkpoint and prune (1/16 of the file system, 1-256 MiB). The
    WAL is kept within a quarter of it (``journal_size_limit`` and :meth:`StoreWriter._bound_wal`)."""

    def __init__(self, db: Path, *, only_if_free: bool = False) -> None:
        self.path = db.with_name(db.name + ".reserve")
        self.size = 256 << 20
        try:
            st = os.statvfs(db.parent)
            self.size = min(256 << 20, max(1 << 20, st.f_blocks * st.f_frsize // 16))
            if only_if_free and st.f_bavail * st.f_frsize < 2 * self.size:
                return  # the room is needed for the WAL now
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except OSError:
            self.release()  # no room even for the reserve: the writer will meet the full disk soon

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


class StoreWriter:
    """Single writer. Not thread-safe: call it from one thread (the agent's writer task)."""

    def __init__(self, path: str | Path, identity: Identity, *, checkpoint_interval_s: float = 0.5) -> None:
        self.path = Path(path).expanduser()
        self.identity = identity
        validate_node_name(identity.node)
        self._lock = WriterLock(self.path)  # one writer per database: a second one fails here, at once
        try:
            self.conn = open_writable(self.path)
        except BaseException:
            self._lock.release()
            raise
        lit = ",".join(
            _sql_literal(v) for v in (identity.node, identity.rank, identity.local_rank, identity.world_size)
        )
        self._node_lit = _sql_literal(identity.node)
        prefix = _sql_literal(identity.node + ":")
        nf = len(EVENT_FIELDS)
        head = f"INSERT INTO events(id,{','.join(EVENT_FIELDS)},node,rank,local_rank,world_size) VALUES "
        self._sql_one = head + f"({prefix}||?1,{','.join(f'?{2 + f}' for f in range(nf))},{lit})"
        self._sql_many = head + ",".join(
            f"({prefix}||(?1+{r}),{','.join(f'?{2 + r * nf + f}' for f in range(nf))},{lit})"
            for r in range(ROWS_PER_STATEMENT)
        )
        self._reserve = _Reserve(self.path)
        self._wal = self.path.with_name(self.path.name + "-wal")
        self.conn.execute(f"PRAGMA journal_size_limit = {self._reserve.size // 4}")
        self.disk_full = False  # set by make_room(): write in small checkpointed transactions from now
        self.full_limit_bytes = 0  # live data kept within this once the disk was full (0: no limit)
        self.pruned_when_full = 0  # events deleted since to stay within it
        self._checkpointer = _Checkpointer(self.path, checkpoint_interval_s)
        self._checkpointer.start()
        self._closed = False

    # --- sequence ------------------------------------------------------------------------------

    def _load_seq(self) -> int:
        node = self.identity.node
        row = self.conn.execute("SELECT next_seq FROM node_seq WHERE node = ?", (node,)).fetchone()
        if row is not None:
            return int(row[0])
        # Database written before node_seq existed (e.g. an Ingero one): derive once from ids.
        start = len(node) + 2
        found = self.conn.execute(
            "SELECT max(CAST(substr(id, ?) AS INTEGER)) FROM events WHERE node = ?", (start, node)
        ).fetchone()[0]
        return int(found) + 1 if found is not None else 1

    # --- transactions --------------------------------------------------------------------------

    def _begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        self.conn.execute("COMMIT")

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def write_batch(
        self,
        events: Sequence[EventRow] = (),
        *,
        stacks: Iterable[tuple[int, str, str]] = (),
        aggregates: Iterable[Sequence[int]] = (),
        snapshots: Iterable[tuple[int, float, float, int, int, float]] = (),
        process_names: Iterable[tuple[int, str, int]] = (),
        nccl_comms: Iterable[tuple[int, ...]] = (),
        nccl_calls: Iterable[tuple[int, ...]] = (),
        annotations: Iterable[tuple[int | str, ...]] = (),
        engine_metrics: Iterable[tuple[int | str | float, ...]] = (),
        cgroups: Iterable[tuple[int | str, ...]] = (),
    ) -> int:
        """Write everything given in one transaction. Returns the number of events written.

        ``nccl_comms``: (comm, pid, rank, nranks, seen_at[, comm_id]); ``nccl_calls``: (pid, tid, comm,
        seq, op, timestamp, duration, datatype, redop, count, bytes, peer, ret_code) — a call written
        again with the same (pid, tid, timestamp) replaces the first row (an entry record, duration
        −1, completed by its return); ``annotations``: rows of :data:`ingero.store.annotations.ROW_COLUMNS`
        (the annotation socket's); ``engine_metrics``: rows of :data:`ingero.store.engine_metrics.ROW_COLUMNS`
        (``trace --inference``); see :mod:`ingero.store.schema`."""
        try:
            self._begin()
            n = self._insert_events(events)
            self._insert_stacks(stacks)
            self._merge_aggregates(aggregates)
            self.conn.executemany(
                "INSERT OR IGNORE INTO system_snapshots(timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, "
                f"load_avg, node) VALUES (?, ?, ?, ?, ?, ?, {self._node_lit})",
                snapshots,
            )
            self.conn.executemany(
                "INSERT INTO process_names(pid, name, seen_at) VALUES (?, ?, ?) "
                "ON CONFLICT(pid) DO UPDATE SET name = excluded.name, seen_at = excluded.seen_at",
                process_names,
            )
            self.conn.executemany(
                "INSERT OR REPLACE INTO nccl_comms(comm, pid, rank, nranks, seen_at, comm_id, node) "
                f"VALUES (?, ?, ?, ?, ?, ?, {self._node_lit})",
                (r if len(r) == 6 else (*r, 0) for r in nccl_comms),
            )
            self.conn.executemany(
                "INSERT OR REPLACE INTO nccl_calls(pid, tid, comm, seq, op, timestamp, duration, datatype, redop, "
                f"count, bytes, peer, ret_code, node) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {self._node_lit})",
                nccl_calls,
            )
            self.conn.executemany(annotations_insert_sql(self._node_lit), annotations)
            self.conn.executemany(engine_metrics_insert_sql(self._node_lit), engine_metrics)
            self.conn.executemany(CGROUP_INSERT_SQL, cgroups)
            self._commit()
        except sqlite3.Error as e:
            self._rollback()
            raise translate(e, self.path) from None
        except BaseException:
            self._rollback()
            raise
        self._bound_wal()
        return n

    def rows_per_transaction(self) -> int:
        """Event rows one transaction should carry at most: its WAL frames must fit in the share of
        the reserve kept for the WAL (see :class:`_Reserve`), and fewer once the disk was full."""
        if self.disk_full:
            return FULL_DISK_ROWS_PER_TRANSACTION
        return max(FULL_DISK_ROWS_PER_TRANSACTION, self._reserve.size // 4 // WAL_BYTES_PER_ROW)

    def _bound_wal(self) -> None:
        """Keep the WAL within a quarter of the reserve's size: frames not yet checkpointed need room in the
        database file, and on a full disk only the reserve can give it. The background checkpointer
        does this off the insert path; this catches up only when it lags behind a burst."""
        try:
            big = os.stat(self._wal).st_size > self._reserve.size // 4
        except OSError:
            return
        if big or self.disk_full:
            self.checkpoint()
        if self.disk_full:
            try:
                self._keep_within_full_limit()
            except sqlite3.Error as e:
                self._rollback()
                raise translate(e, self.path) from None

    def _insert_events(self, events: Sequence[EventRow]) -> int:
        n = len(events)
        if not n:
            return 0
        seq = self._load_seq()  # under the write lock (BEGIN IMMEDIATE): authoritative
        k = ROWS_PER_STATEMENT
        full = n - n % k
        if full:
            chain = itertools.chain.from_iterable
            self.conn.executemany(self._sql_many, ([seq + i, *chain(events[i : i + k])] for i in range(0, full, k)))
        if full < n:
            self.conn.executemany(self._sql_one, ((seq + i, *events[i]) for i in range(full, n)))
        self.conn.execute(
            "INSERT INTO node_seq(node, next_seq) VALUES (?, ?) "
            "ON CONFLICT(node) DO UPDATE SET next_seq = excluded.next_seq",
            (self.identity.node, seq + n),
        )
        return n

    def _insert_stacks(self, stacks: Iterable[tuple[int, str, str]]) -> None:
        self.conn.executemany("INSERT OR IGNORE INTO stack_traces(hash, ips, frames) VALUES (?, ?, ?)", stacks)

    def _merge_aggregates(self, rows: Iterable[Sequence[int]]) -> None:
        """Rows of :data:`~ingero.store.schema.AGGREGATE_COLUMNS` (bucket, source, op, pid, count, stored,
        sum_dur, min_dur, max_dur, sum_arg0), merged into this node's."""
        self.conn.executemany(
            f"INSERT INTO event_aggregates({', '.join(AGGREGATE_COLUMNS)}, node) "
            f"VALUES ({', '.join('?' * len(AGGREGATE_COLUMNS))}, {self._node_lit}) {AGGREGATES_UPSERT}",
            rows,
        )

    # --- sessions and chains -------------------------------------------------------------------

    def start_session(self, info: dict[str, Any] | None = None, *, started_at: int | None = None) -> int:
        info = dict(info or {})
        unknown = set(info) - set(SESSION_FIELDS)
        if unknown:
            raise StoreError(f"unknown session field(s): {', '.join(sorted(unknown))}")
        ident = self.identity
        cols = ["started_at", "ingero_ver", "node", "rank", "local_rank", "world_size", *info]
        vals = [
            started_at or now_ns(),
            f"ingero-py {__version__}",
            ident.node,
            ident.rank,
            ident.local_rank,
            ident.world_size,
            *info.values(),
        ]
        try:
            cur = self.conn.execute(
                f"INSERT INTO sessions({','.join(cols)}) VALUES ({','.join('?' * len(cols))})", vals
            )
        except sqlite3.Error as e:
            raise translate(e, self.path) from None
        return int(cur.lastrowid or 0)

    def end_session(
        self, session_id: int, stats: dict[str, int] | None = None, *, stopped_at: int | None = None
    ) -> None:
        try:
            self._begin()
            self.conn.execute("UPDATE sessions SET stopped_at = ? WHERE id = ?", (stopped_at or now_ns(), session_id))
            self._put_stats(session_id, stats or {})
            self._commit()
        except sqlite3.Error as e:
            self._rollback()
            raise translate(e, self.path) from None

    def save_stats(self, session_id: int, stats: dict[str, int]) -> None:
        """Store a running session's counters (seen, stored, dropped, ...) so readers see them live."""
        try:
            self._put_stats(session_id, stats)
        except sqlite3.Error as e:
            raise translate(e, self.path) from None

    def _put_stats(self, session_id: int, stats: dict[str, int]) -> None:
        self.conn.executemany(
            "INSERT OR REPLACE INTO session_stats(session_id, key, value) VALUES (?, ?, ?)",
            ((session_id, k, int(v)) for k, v in stats.items()),
        )

    def save_chains(self, chains: Iterable[dict[str, Any]]) -> int:
        """Upsert causal chains (dicts with CHAIN_FIELDS; lists/dicts are stored as JSON)."""
        rows = []
        for ch in chains:
            row = []
            for f in CHAIN_FIELDS:
                v = ch.get(f, "" if f not in ("cuda_p99_us", "cuda_p50_us", "tail_ratio") else 0)
                if f == "node" and not v:
                    v = self.identity.node
                if isinstance(v, list | dict):
                    v = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
                row.append(v)
            rows.append(row)
        try:
            self._begin()
            self.conn.executemany(
                f"INSERT OR REPLACE INTO causal_chains({','.join(CHAIN_FIELDS)}) "
                f"VALUES ({','.join('?' * len(CHAIN_FIELDS))})",
                rows,
            )
            self._commit()
        except sqlite3.Error as e:
            self._rollback()
            raise translate(e, self.path) from None
        return len(rows)

    # --- size management -----------------------------------------------------------------------

    def size_bytes(self) -> int:
        page_count = self.conn.execute("PRAGMA page_count").fetchone()[0]
        freelist = self.conn.execute("PRAGMA freelist_count").fetchone()[0]
        page_size = self.conn.execute("PRAGMA page_size").fetchone()[0]
        return int((page_count - freelist) * page_size)

    def prune_oldest(self, max_bytes: int, *, step_fraction: float = 0.1) -> int:
        """Delete the oldest events until the live data fits ``max_bytes``. Returns rows deleted.

        Freed pages are reused by later inserts (the file does not shrink, it stops growing).
        Aggregates are kept: they still count what was pruned.
        """
        deleted = 0
        try:
            while self.size_bytes() > max_bytes:
                total = self.conn.execute("SELECT count(*) FROM events").fetchone()[0]
                if not total:
                    break
                n = max(1, int(total * step_fraction))
                cur = self.conn.execute(
                    "DELETE FROM events WHERE rowid IN (SELECT rowid FROM events ORDER BY timestamp LIMIT ?)",
                    (n,),
                )
                deleted += cur.rowcount
        except sqlite3.Error as e:
            raise translate(e, self.path) from None
        return deleted

    def unstore(self, rows: Sequence[Sequence[int]]) -> None:
        """Event rows that were counted as stored in ``event_aggregates`` but could not be written (the
        disk was full): take them out of the ``stored`` counts (they stay in ``count``). A disk too full
        for even this update leaves the counts as they are (the session's stats still say how many)."""
        keys: dict[tuple[int, int, int, int], int] = {}
        for r in rows:
            key = (int(r[0]) // AGGREGATE_BUCKET_NS * AGGREGATE_BUCKET_NS, int(r[3]), int(r[4]), int(r[1]))
            keys[key] = keys.get(key, 0) + 1
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "UPDATE event_aggregates SET stored = max(stored - ?, 0) "
                f"WHERE bucket = ? AND source = ? AND op = ? AND pid = ? AND node = {self._node_lit}",
                [(n, *key) for key, n in keys.items()],
            )
            self.conn.execute("COMMIT")
        except sqlite3.Error as e:
            self._rollback()
            if not is_disk_full(e):
                raise translate(e, self.path) from None

    def make_room(self, fraction: float = 0.1) -> int:
        """After a disk-full error: delete the oldest ``fraction`` of the events (aggregates keep
        counting them), so later inserts reuse their pages. Returns rows deleted (0: nothing could be
        freed — no events left, or even a small delete did not fit).

        In WAL mode every change needs room in the WAL first and a checkpoint can grow the database:
        the emergency reserve (``<db>.reserve``, made at open) is given back to the file system first,
        then the oldest events go in small transactions, each checkpointed, so the WAL is reused
        instead of growing. From then on the live data is kept within what it is now, as ``--max-db``
        would (the file no longer grows: inserts reuse the freed pages).
        """
        self._rollback()
        self._reserve.release()
        self.disk_full = True
        deleted = 0
        try:
            self.checkpoint(truncate=True)  # the WAL can hold much of what is left of the disk
            total = self.conn.execute("SELECT count(*) FROM events").fetchone()[0]
            deleted = self._delete_oldest(max(1, int(total * fraction)), max(1, int(total * PRUNE_STEP_FRACTION)))
            self.checkpoint(truncate=True)
            self.full_limit_bytes = self.size_bytes()
        except sqlite3.Error as e:
            self._rollback()
            if not is_disk_full(e):
                raise translate(e, self.path) from None
        self._reserve = _Reserve(self.path, only_if_free=True)  # for the next time, if there is room
        return deleted

    def _delete_oldest(self, goal: int, step: int) -> int:
        deleted = 0
        while deleted < goal:
            cur = self.conn.execute(
                "DELETE FROM events WHERE rowid IN (SELECT rowid FROM events ORDER BY timestamp LIMIT ?)",
                (min(step, goal - deleted),),
            )
            if cur.rowcount <= 0:
                break
            deleted += int(cur.rowcount)
            self.checkpoint()
        return deleted

    def _keep_within_full_limit(self) -> None:
        """Once the disk was full: prune the oldest events whenever the live data outgrows the size
        it had after pruning (a little at a time), so the file never has to grow again."""
        if not self.full_limit_bytes or self.size_bytes() <= self.full_limit_bytes:
            return
        total = self.conn.execute("SELECT count(*) FROM events").fetchone()[0]
        step = max(1, int(total * PRUNE_STEP_FRACTION))
        while self.size_bytes() > self.full_limit_bytes * (1 - PRUNE_STEP_FRACTION):
            n = self._delete_oldest(step, step)
            self.pruned_when_full += n
            if not n:
                break

    def checkpoint(self, *, truncate: bool = False) -> None:
        """A PASSIVE WAL checkpoint from the writer's connection (busy readers: partial, no error);
        ``truncate``: also shrink the WAL file to nothing when every frame could be copied."""
        try:
            self.conn.execute(f"PRAGMA wal_checkpoint({'TRUNCATE' if truncate else 'PASSIVE'})").fetchone()
        except sqlite3.Error as e:
            if not is_disk_full(e) and errorname(e) not in ("SQLITE_BUSY", "SQLITE_LOCKED"):
                raise translate(e, self.path) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._checkpointer.stop()
        try:
            self._rollback()
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error:
            pass  # another reader holds the WAL: the next open checkpoints it
        finally:
            self.conn.close()
            self._reserve.release()
            self._lock.release()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
