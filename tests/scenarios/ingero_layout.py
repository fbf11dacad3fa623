"""Rewrite a database as ingero records it into what Ingero's Go tracer (schema_info 0.9) would have
written for the same run — the layout users bring first.

What differs, read off Ingero's own databases (``tests/data/ingero-samples``, whose DDL this copies
verbatim) and its BPF sources:

* ``sched_switch``: no ``prev_state`` and no preemptor — ``arg0`` = 0, ``arg1`` = the thread itself,
  and ``pid`` = ``tid`` = the thread (Ingero emits the switched-in task's id for both). Off-CPU time
  (``duration``) and the back-on-CPU timestamp are kept.
* ``sched_wakeup``: the *waker's* event, as Ingero's host tracer emits it (``bpf/host_trace.bpf.c``,
  ``internal/ebpf/host/host.go``): ``pid`` = ``tid`` = the waker (its tgid: ingero records no waker tid),
  ``duration`` 0 (no time since the thread left), ``arg0`` 0, ``arg1`` = the woken thread.
* socket calls (``net_send``/``net_recv``), as Ingero's ``bpf/net_trace.bpf.c`` and
  ``internal/ebpf/net`` write them: ``timestamp`` = the call's *return* (ours: its entry), ``arg0`` = the
  fd, ``arg1`` = bytes (ours: bytes, then the fd). Ingero traces only the ``sendto``/``recvfrom``
  syscalls (what libc's send/recv make) and, after its first 10 s, stores only the socket calls slower
  than 3x their median (``shouldStore`` in its ``trace.go``): every scenario lasts under 10 s, inside
  that bootstrap, where it stores them all — as kept here.
* NCCL (our source 9), ``nccl_comms``/``nccl_calls``, ``node_seq``, ``session_stats``: absent (Ingero
  0.9 has no such source or tables); ``rank``/``local_rank``/``world_size`` are NULL as in its
  samples; ``system_snapshots`` has no ``node`` column; ``cgroup_metadata`` no ``job_id``.
* ``sources``/``ops``/``schema_info``: Ingero's rows; ``PRAGMA user_version`` 0.

Events keep their ``{node}:{seq}`` ids, timestamps (the socket calls' aside), durations and every other column.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ingero.store.catalog import NCCL, NET, op_id

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "ingero-samples" / "sample-gpu-node-02.db"
SCHED_SWITCH, SCHED_WAKEUP = op_id("sched_switch"), op_id("sched_wakeup")
COPIED_FROM_TEMPLATE = ("sources", "ops", "schema_info")
BOOTSTRAP_NS = 10 * 1_000_000_000  # Ingero stores every socket call this long after it starts, then only slow ones
EVENT_COLUMNS = (
    "id, timestamp, pid, tid, source, op, duration, gpu_id, arg0, arg1, ret_code, stack_hash, node, "
    "rank, local_rank, world_size, stack_ips, cgroup_id"
)


def _columns(conn: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def rewrite(src: Path, dst: Path, template: Path = TEMPLATE) -> Path:
    """Write ``dst`` (which must not exist): ``src`` in Ingero's layout."""
    if dst.exists():
        raise FileExistsError(dst)
    tpl = sqlite3.connect(f"file:{template}?mode=ro&immutable=1", uri=True)  # never a -wal/-shm beside it
    try:
        ddl = [
            (name, sql)
            for kind, name, sql in tpl.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type DESC, rowid")
            if sql and name != "sqlite_sequence" and kind in ("table", "index")
        ]
        fixed = {t: tpl.execute(f"SELECT * FROM {t}").fetchall() for t in COPIED_FROM_TEMPLATE}
    finally:
        tpl.close()
    conn = sqlite3.connect(dst, isolation_level=None)
    try:
        conn.execute("BEGIN")
        for _, sql in ddl:
            conn.execute(sql)
        for table, rows in fixed.items():
            if rows:
                conn.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
        # immutable: a written, closed recording; read-only alone would leave a -wal/-shm beside it
        conn.execute("ATTACH DATABASE ? AS rec", (f"file:{src}?mode=ro&immutable=1",))
        late = conn.execute(
            "SELECT count(*) FROM rec.events e JOIN (SELECT node, min(timestamp) AS t0 FROM rec.events GROUP BY node) f "
            "ON e.node = f.node WHERE e.source = ? AND e.timestamp + e.duration > f.t0 + ?",
            (NET, BOOTSTRAP_NS),
        ).fetchone()[0]
        if late:  # Ingero would have kept only the slow ones: not modelled here
            raise ValueError(f"{src}: {late} socket calls after Ingero's {BOOTSTRAP_NS // 10**9} s bootstrap")
        conn.execute(
            f"INSERT INTO events({EVENT_COLUMNS}) SELECT id, "
            "CASE WHEN is_net THEN timestamp + duration ELSE timestamp END AS ts, "
            "CASE WHEN is_switch THEN tid WHEN is_wakeup THEN arg0 ELSE pid END, "
            "CASE WHEN is_wakeup THEN arg0 ELSE tid END, source, op, "
            "CASE WHEN is_wakeup THEN 0 ELSE duration END, gpu_id, "
            "CASE WHEN is_switch OR is_wakeup THEN 0 WHEN is_net THEN arg1 ELSE arg0 END, "
            "CASE WHEN is_switch OR is_wakeup THEN tid WHEN is_net THEN arg0 ELSE arg1 END, "
            "ret_code, stack_hash, node, NULL, NULL, NULL, '', cgroup_id "
            "FROM (SELECT *, (source = ? AND op = ?) AS is_switch, (source = ? AND op = ?) AS is_wakeup, "
            "source = ? AS is_net FROM rec.events) "
            "WHERE source != ? ORDER BY ts",
            (*SCHED_SWITCH, *SCHED_WAKEUP, NET, NCCL),
        )
        tables = [n for n, sql in ddl if sql.startswith("CREATE TABLE")]
        for table in tables:
            if table in (*COPIED_FROM_TEMPLATE, "events"):
                continue
            ours = set(_columns(conn, "rec", table))
            cols = ",".join(c for c in _columns(conn, "main", table) if c in ours)
            if cols:
                conn.execute(f"INSERT OR IGNORE INTO {table}({cols}) SELECT {cols} FROM rec.{table}")
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE rec")
    finally:
        conn.close()
    return dst
