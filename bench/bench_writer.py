"""Store writer throughput: events/s into a fresh database (target ≥ 300 k events/s on 1 M events).

Measured side by side in one run, each timed the same way: from the first insert until the rows are
in the database file itself — the WAL checkpointed (TRUNCATE) and the connection closed — so no
variant leaves work outside its timed region that another pays inside it:
  writer     StoreWriter.write_batch() in batches (what the tracer's pipeline does)
  floor      the same rows inserted by SQLite alone (INSERT INTO events SELECT ... FROM a temp table),
             i.e. what SQLite needs for Ingero's schema (text primary key + 4 indexes) with no Python
  naive      plain executemany of one-row INSERTs with default autocheckpointing (the obvious version),
             then the same final TRUNCATE checkpoint the writer's close() runs
  ingero-ix  the writer on a database created with Ingero's exact DDL (text primary key on id, indexes on
             pid, (source, op, stack_hash), cgroup_id): why ingero's events table keeps only the
             timestamp index (see ingero/store/schema.py)

Usage: .venv/bin/python bench/bench_writer.py [--events N] [--batch N] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verdict import Target, no_verdict, summary, verdict

from ingero.identity import Identity
from ingero.store.db import open_writable
from ingero.store.writer import EVENT_FIELDS, EventRow, StoreWriter

TARGET = Target(300_000, " events/s", at_least=True, fmt="{:,.0f}")
TARGET_EVENTS = 1_000_000  # the database size the target is set on


def make_events(n: int) -> list[EventRow]:
    """A realistic mix: CUDA/driver calls, sched_switch, block I/O, a few pids."""
    rng = random.Random(7)
    t = 1_775_218_723_000_000_000
    kinds = [(1, 3), (1, 1), (4, 1), (3, 1), (3, 1), (5, 2), (1, 5)]
    rows = []
    for i in range(n):
        t += rng.randint(500, 5000)
        source, op = kinds[i % len(kinds)]
        pid = 4000 + i % 3
        rows.append(
            (t, pid, pid + i % 7, source, op, rng.randint(1000, 900_000), 0, rng.randint(0, 1 << 30), 0, 0, 0, 0)
        )
    return rows


def fresh(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)


def bench_writer(path: Path, rows: list[EventRow], batch: int, *, fresh_db: bool = True) -> float:
    if fresh_db:
        fresh(path)
    w = StoreWriter(path, Identity("bench-node", rank=0, local_rank=0, world_size=1))
    t0 = time.perf_counter()
    for i in range(0, len(rows), batch):
        w.write_batch(rows[i : i + batch])
    w.close()  # its TRUNCATE checkpoint: inside the timed region, as the others' checkpoints are
    return time.perf_counter() - t0


def checkpoint_and_close(conn: sqlite3.Connection) -> None:
    """What StoreWriter.close() ends with: the WAL checkpointed into the file and truncated."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    conn.close()


def ingero_ddl() -> list[str]:
    """Ingero's own DDL, read from its sample database."""
    sample = Path(__file__).resolve().parents[1] / "tests" / "data" / "ingero-samples" / "sample-gpu-node-01.db"
    conn = sqlite3.connect(f"file:{sample}?mode=ro&immutable=1", uri=True)
    ddl = [
        r[0] for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name != 'sqlite_sequence'")
    ]
    conn.close()
    return ddl


def bench_ingero_indexes(path: Path, rows: list[EventRow], batch: int, ddl: list[str]) -> float:
    fresh(path)
    conn = sqlite3.connect(path)
    for stmt in ddl:
        conn.execute(stmt)
    conn.commit()
    conn.close()
    return bench_writer(path, rows, batch, fresh_db=False)


def bench_floor(path: Path, rows: list[EventRow]) -> float:
    fresh(path)
    conn = open_writable(path)
    conn.execute(f"CREATE TEMP TABLE stage(seq, {', '.join(EVENT_FIELDS)})")
    conn.executemany(
        f"INSERT INTO temp.stage VALUES ({','.join('?' * (len(EVENT_FIELDS) + 1))})",
        [(i + 1, *r) for i, r in enumerate(rows)],
    )
    t0 = time.perf_counter()
    conn.execute("BEGIN")
    conn.execute(
        f"INSERT INTO events(id, {', '.join(EVENT_FIELDS)}, node, rank, local_rank, world_size) "
        f"SELECT 'bench-node:' || seq, {', '.join(EVENT_FIELDS)}, 'bench-node', 0, 0, 1 FROM temp.stage"
    )
    conn.execute("COMMIT")
    checkpoint_and_close(conn)
    return time.perf_counter() - t0


def bench_naive(path: Path, rows: list[EventRow], batch: int) -> float:
    fresh(path)
    conn = open_writable(path)
    conn.execute("PRAGMA wal_autocheckpoint = 1000")
    sql = (
        f"INSERT INTO events(id, {', '.join(EVENT_FIELDS)}, node, rank, local_rank, world_size) "
        f"VALUES (?, {','.join('?' * len(EVENT_FIELDS))}, ?, ?, ?, ?)"
    )
    t0 = time.perf_counter()
    seq = 1
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        conn.execute("BEGIN")
        conn.executemany(sql, [(f"bench-node:{seq + j}", *r, "bench-node", 0, 0, 1) for j, r in enumerate(chunk)])
        conn.execute("COMMIT")
        seq += len(chunk)
    checkpoint_and_close(conn)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=TARGET_EVENTS)
    ap.add_argument("--batch", type=int, default=8192, help="events per transaction (pipeline batch)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="200k events, one repetition (no verdict: target on 1 M)")
    args = ap.parse_args()
    if args.quick:
        args.events, args.repeat = 200_000, 1
    rows = make_events(args.events)
    with tempfile.TemporaryDirectory(prefix="ingero-bench-") as d:
        path = Path(d) / "bench.db"
        ddl = ingero_ddl()
        res: dict[str, list[float]] = {"writer": [], "floor": [], "naive": [], "ingero-ix": []}
        size = 0
        for _ in range(args.repeat):  # interleaved, so machine noise hits all of them alike
            res["writer"].append(bench_writer(path, rows, args.batch))
            size = os.path.getsize(path)
            res["floor"].append(bench_floor(path, rows))
            res["naive"].append(bench_naive(path, rows, args.batch))
            res["ingero-ix"].append(bench_ingero_indexes(path, rows, args.batch, ddl))
    n = args.events
    best = {k: min(v) for k, v in res.items()}
    print(
        f"store writer: {n:,} events into a fresh DB, batches of {args.batch}, best of {args.repeat} "
        f"(median in brackets); file {size / 1e6:.0f} MB"
    )
    for k in ("writer", "floor", "naive", "ingero-ix"):
        print(f"  {k:9s} {n / best[k]:>11,.0f} events/s   [{n / statistics.median(res[k]):>9,.0f}]   {best[k]:.2f} s")
    print(
        f"  writer / SQLite floor time ratio: {best['writer'] / best['floor']:.2f}x;  "
        f"writer vs naive: {best['naive'] / best['writer']:.2f}x faster"
    )
    if n >= TARGET_EVENTS:
        verdict(f"writer rate, {n:,} events", n / best["writer"], TARGET)
    else:
        no_verdict(f"writer rate, {n:,} events", n / best["writer"], TARGET, f"target on {TARGET_EVENTS:,} events")
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
