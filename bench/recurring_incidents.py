"""The recurring-incident shape for explain's speed (issue #20, item 7): a long recording with hundreds
of slow windows.

``investigations/sample-gpu-node-01.db`` (90 s of a training rank with CPU contention from t=20 s and
a checkpoint write every 30 s) is replayed ``copies`` times back to back, each copy's timestamps
shifted by its index x the recording's span (events and system snapshots; the rest of the database is
the sample's own). 202 copies make ~1 M events and ~800 windows of slow calls: explain's per-window
work must not grow with their number.

Measured side by side in one run, the functions taking turns (a drifting load shifts them alike): ``explain()``
(one connection, the agent API; and over the CLI's reading threads) against the ``sqlite3`` shell fetching
the columns explain reads (bench/explain_baseline.py, the yardstick of bench_explain.py too). Target:
explain ≤ 1.2x that fetch. Shown beside it: a Python cursor fetching six per-row columns into numpy
(what reading the rows one by one would cost), and every ratio in CPU time as well (no verdict).

    .venv/bin/python bench/recurring_incidents.py             # 202 copies, ~1 M events
    .venv/bin/python bench/recurring_incidents.py --quick     # 40 copies: a smoke run, no verdict
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from explain_baseline import columns_read, interleaved, sqlite3_fetch
from verdict import Target, no_verdict, summary, verdict

from ingero.cli.explain import read_threads
from ingero.explain.engine import explain
from ingero.explain.hugepages import prefer_small_pages
from ingero.explain.memory_policy import one_shot
from ingero.store.db import open_readonly

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "investigations" / "sample-gpu-node-01.db"
COPIES = 202
RATIO = Target(1.2, "x")
EVENT_COLUMNS = "id, timestamp, pid, tid, source, op, duration, gpu_id, arg0, arg1, ret_code, stack_hash, node, rank, local_rank, world_size, stack_ips, cgroup_id"
SNAPSHOT_COLUMNS = "timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg, node"


def build(path: Path, copies: int = COPIES, sample: Path = SAMPLE) -> int:
    """Write the replayed database at ``path``; returns its event count."""
    src = sqlite3.connect(f"file:{sample}?mode=ro&immutable=1", uri=True)  # never a -wal beside the committed file
    dst = sqlite3.connect(path)
    try:
        src.backup(dst)
    finally:
        src.close()
    try:
        lo, hi = dst.execute("SELECT min(timestamp), max(timestamp) FROM events").fetchone()
        step = int(hi - lo) + 1_000_000_000  # a second between copies
        shifted = EVENT_COLUMNS.replace("id, timestamp", "id || ':r' || k, timestamp + k * ?")
        snap = SNAPSHOT_COLUMNS.replace("timestamp", "timestamp + k * ?", 1)
        with dst:
            dst.execute("CREATE TEMP TABLE k(k INTEGER PRIMARY KEY)")
            dst.executemany("INSERT INTO k VALUES (?)", [(k,) for k in range(1, copies)])
            dst.execute("DELETE FROM causal_chains")
            dst.execute(
                f"INSERT INTO events ({EVENT_COLUMNS}) SELECT {shifted} FROM events, temp.k ORDER BY k, events.rowid",
                (step,),
            )
            dst.execute(
                f"INSERT OR IGNORE INTO system_snapshots ({SNAPSHOT_COLUMNS}) SELECT {snap} FROM system_snapshots, temp.k",
                (step,),
            )
        return int(dst.execute("SELECT count(*) FROM events").fetchone()[0])
    finally:
        dst.close()


def cursor_fetch(conn: sqlite3.Connection) -> None:
    """The baseline: the per-row columns explain's frames hold, fetched as row tuples into numpy."""
    dt = np.dtype([(c, np.int64) for c in ("s", "o", "d", "t", "p", "e")])
    np.fromiter(conn.execute("SELECT source, op, duration, timestamp, pid, ret_code != 0 FROM events"), dtype=dt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 copies: a smoke run (no verdict)")
    ap.add_argument("--copies", type=int, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="write the database here and keep it")
    args = ap.parse_args()
    prefer_small_pages()  # as the CLI and the agent do (ingero.explain.hugepages)
    one_shot()  # as the CLI does (ingero.explain.memory_policy)
    copies = args.copies or (40 if args.quick else COPIES)
    repeat = 2 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        db = args.keep or Path(tmp) / "recurring.db"
        db.unlink(missing_ok=True)
        t = time.perf_counter()
        n = build(db, copies)
        print(f"built {n:,} events ({copies} copies of {SAMPLE.name}) in {time.perf_counter() - t:.1f}s")
        conn = open_readonly(db)
        threads = read_threads()
        try:
            report = explain(conn)
            columns = columns_read(conn)
            wall, cpu = interleaved(
                {
                    "fetch": lambda: sqlite3_fetch(db, columns),
                    "cursor": lambda: cursor_fetch(conn),
                    "serial": lambda: explain(conn),
                    "threads": lambda: explain(conn, threads=threads),
                },
                repeat,
            )
        finally:
            conn.close()
    print(f"sqlite3 fetching the {len(columns)} columns explain reads (baseline)  {wall['fetch']:6.2f} s")
    print(f"cursor fetch of 6 columns into numpy                {wall['cursor']:6.2f} s")
    print(f"explain, one connection (the agent API)             {wall['serial']:6.2f} s")
    print(f"explain, {threads} reading threads (the CLI)               {wall['threads']:6.2f} s")
    print("CPU time ratios: " + ", ".join(f"{k} {cpu[k] / cpu['fetch']:.2f}x" for k in ("cursor", "serial", "threads")))
    print(f"chains: {[(c.severity, c.family, c.cuda_op) for c in report.chains]}")
    full = copies == COPIES and not args.quick
    for name, key in (
        ("explain (one connection) / sqlite3 fetch", "serial"),
        ("explain (CLI threads) / sqlite3 fetch", "threads"),
    ):
        ratio = wall[key] / wall["fetch"]
        if full:
            verdict(name, ratio, RATIO, detail=f"{n:,} events")
        else:
            no_verdict(name, ratio, RATIO, f"{copies} copies, not {COPIES}", detail=f"{n:,} events")
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
