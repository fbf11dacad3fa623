"""Merge throughput: ``ingero merge`` of 3 node databases vs SQLite's raw ``INSERT ... SELECT`` floor.

Target: merge time ≤ 1.5x the floor, for 3 × 1 M-event databases.

Measured side by side in one run, alternating, best of --repeat:
  merge        ingero.store.merge.merge_databases(): read-only inspection of each input (nodes, ranges,
               id sequences), then every table copied with ATTACH + INSERT ... SELECT, timestamp index
               rebuilt once, node_seq/report/skew check, written to a temp file and renamed into place
  floor        the same events only, copied by SQLite alone into a fresh ingero database
               (ATTACH + INSERT INTO events(...) SELECT ... FROM src.events per input) with the same
               bulk pragmas; the faster of two variants: timestamp index kept during the copy, or
               dropped and rebuilt once at the end
Inputs are generated in SQL (a recursive CTE): node-namespaced ids, realistic op mix, 50 stacks per
node (40 shared across nodes), a session and snapshots per node.

Usage: .venv/bin/python bench/bench_merge.py [--events N] [--nodes N] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verdict import Target, no_verdict, summary, verdict

from ingero.store.db import open_writable
from ingero.store.merge import merge_databases

TARGET = Target(1.5, "x")
TARGET_EVENTS = 1_000_000  # per node database: the size the target is set on
T0 = 1_775_218_723_000_000_000
COLS = (
    "id, timestamp, pid, tid, source, op, duration, gpu_id, arg0, arg1, ret_code, stack_hash, node, rank, "
    "local_rank, world_size, stack_ips, cgroup_id"
)


def make_node_db(path: Path, node: str, rank: int, world: int, n: int) -> None:
    """A node database through the real schema, filled by SQLite (fast to build, realistic shape)."""
    conn = open_writable(path)
    q = "'" + node + "'"
    conn.execute("BEGIN")
    conn.execute(
        f"""
        WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < {n})
        INSERT INTO events({COLS})
        SELECT {q} || ':' || i,
               {T0 + rank * 1000} + i * 2750 + (abs(random()) % 500),
               4000 + i % 3, 4000 + i % 7,
               CASE i % 7 WHEN 0 THEN 1 WHEN 1 THEN 1 WHEN 2 THEN 4 WHEN 3 THEN 3 WHEN 4 THEN 3 WHEN 5 THEN 5 ELSE 1 END,
               CASE i % 7 WHEN 0 THEN 3 WHEN 1 THEN 1 WHEN 2 THEN 1 WHEN 3 THEN 1 WHEN 4 THEN 1 WHEN 5 THEN 2 ELSE 5 END,
               1000 + abs(random()) % 900000, 0, abs(random()) % 1073741824, 0, 0,
               CASE WHEN i % 7 IN (0, 1, 2, 6) THEN 1 + i % 50 + (CASE WHEN i % 50 >= 40 THEN {rank} * 1000 ELSE 0 END)
                    ELSE 0 END,
               {q}, {rank}, 0, {world}, '', 0
        FROM seq
        """
    )
    conn.execute(
        "WITH RECURSIVE h(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM h WHERE k < 50) "
        "INSERT INTO stack_traces(hash, ips, frames) SELECT k + (CASE WHEN k > 40 THEN ? * 1000 ELSE 0 END), "
        '\'["0x7f00\' || k || \'"]\', \'[{"s":"cudaLaunchKernel","f":"libcudart.so.12"}]\' FROM h',
        (rank,),
    )
    last = T0 + rank * 1000 + n * 2750
    conn.execute(
        "INSERT INTO sessions(started_at, stopped_at, node, rank, local_rank, world_size, ingero_ver) "
        "VALUES (?, ?, ?, ?, 0, ?, 'bench')",
        (T0, last, node, rank, world),
    )
    conn.executemany(
        "INSERT INTO system_snapshots(timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg) "
        "VALUES (?, 50, 40, 8000, 0, 1.5)",
        [(T0 + rank + k * 1_000_000_000,) for k in range(max(1, (last - T0) // 1_000_000_000))],
    )
    conn.execute("INSERT INTO node_seq(node, next_seq) VALUES (?, ?)", (node, n + 1))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    conn.close()


def fresh(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(path) + suffix).unlink(missing_ok=True)


def run_floor(inputs: list[Path], out: Path, *, rebuild_index: bool) -> float:
    fresh(out)
    open_writable(out).close()
    conn = sqlite3.connect(f"file:{urllib.parse.quote(str(out))}", uri=True, isolation_level=None)
    for pragma in ("journal_mode = OFF", "synchronous = OFF", "cache_size = -131072", "temp_store = MEMORY"):
        conn.execute(f"PRAGMA {pragma}").fetchall()
    t0 = time.perf_counter()
    if rebuild_index:
        conn.execute("DROP INDEX idx_events_timestamp")
    for p in inputs:
        conn.execute("ATTACH DATABASE ? AS src", (f"file:{urllib.parse.quote(str(p))}?mode=ro&immutable=1",))
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO main.events({COLS}) SELECT {COLS} FROM src.events")
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE src")
    if rebuild_index:
        conn.execute("CREATE INDEX idx_events_timestamp ON events(timestamp)")
    dt = time.perf_counter() - t0
    conn.close()
    return dt


def run_merge(inputs: list[Path], out: Path) -> tuple[float, int]:
    fresh(out)
    t0 = time.perf_counter()
    report = merge_databases(inputs, out, force=True)
    return time.perf_counter() - t0, report.events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=TARGET_EVENTS, help="events per node database (default 1 M)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 × 50 k events, one repeat (no verdict)")
    args = ap.parse_args()
    if args.quick:
        args.events, args.repeat = 50_000, 1
    with tempfile.TemporaryDirectory(prefix="ingero-bench-merge-") as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        inputs = []
        for k in range(args.nodes):
            p = d / f"gpu-node-{k + 1:02d}.db"
            make_node_db(p, f"gpu-node-{k + 1:02d}", k, args.nodes, args.events)
            inputs.append(p)
        total = args.events * args.nodes
        print(f"inputs: {args.nodes} × {args.events:,} events built in {time.perf_counter() - t:.1f}s")
        merges, floors_kept, floors_rebuilt = [], [], []
        merged = 0
        for _ in range(args.repeat):
            floors_kept.append(run_floor(inputs, d / "floor.db", rebuild_index=False))
            floors_rebuilt.append(run_floor(inputs, d / "floor.db", rebuild_index=True))
            dt, merged = run_merge(inputs, d / "cluster.db")
            merges.append(dt)
        fresh(d / "floor.db")
        m, fk, fr = min(merges), min(floors_kept), min(floors_rebuilt)
        floor = min(fk, fr)
        print(f"floor, index kept     {fk:7.2f}s  {total / fk / 1e6:6.2f} M events/s")
        print(f"floor, index rebuilt  {fr:7.2f}s  {total / fr / 1e6:6.2f} M events/s")
        print(f"ingero merge          {m:7.2f}s  {total / m / 1e6:6.2f} M events/s  (all tables, report, rename)")
        name = f"merge / floor, best of {args.repeat}"
        detail = f"merged {merged:,} of {total:,} events"
        if args.events >= TARGET_EVENTS:
            verdict(name, m / floor, TARGET, complete=merged == total, detail=detail)
        else:
            no_verdict(name, m / floor, TARGET, f"target on {args.nodes} × {TARGET_EVENTS:,} events", detail=detail)
            if merged != total:
                verdict("merge keeps every event", merged, Target(total, at_least=True, fmt="{:,.0f}"))
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
