"""Explain engine speed on a large database.

Target (issue #11): ``explain()`` on a 1M-event database in ≤ 1.0 s (v1 took 2.1-2.2 s with two
SQLite scans), one pass over the events. ``ingero explain --db`` reads a large database's rowid ranges
over one read-only connection per CPU (at most 4, :func:`ingero.cli.explain.read_threads`); the
agent's API keeps one connection (its query budget lives on it): both are measured. The events are loaded with SQLite-side packing
(``group_concat`` of packed 64-bit integers, tid and arguments per row, parsed by numpy) in a single
scan; the baseline measured side by side is the straightforward way, a cursor fetching six columns as
row tuples into ``np.fromiter`` — explain is reported as a ratio to it too, since the absolute time
depends on the machine and its load.

    .venv/bin/python bench/bench_explain.py            # 1M events
    .venv/bin/python bench/bench_explain.py --quick    # 200k events
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from ingero.cli.explain import read_threads
from ingero.explain.engine import explain
from ingero.explain.frame import load_frames
from ingero.explain.stats import op_stats
from ingero.identity import Identity
from ingero.store.db import open_readonly
from ingero.store.writer import StoreWriter

TARGET_S = 1.0
BASE = 1_776_000_000_000_000_000


def make_db(path: Path, n: int) -> None:
    """A trainer (launches + syncs) with a sched_switch storm and slow syncs in the middle, block I/O."""
    rng = np.random.default_rng(1)
    span_s = 600.0
    ts = np.sort(rng.uniform(0, span_s, n))
    kind = rng.choice(4, n, p=[0.6, 0.2, 0.12, 0.08])  # launch, sync, sched_switch, block write
    src = np.array([1, 1, 3, 5])[kind]
    op = np.array([3, 5, 1, 2])[kind]
    dur = np.where(kind == 0, rng.normal(8e3, 800, n), rng.normal(5e6, 2e5, n))
    dur = np.where(kind == 2, rng.uniform(2e4, 8e4, n), dur)
    dur = np.where(kind == 3, rng.uniform(1e6, 4e6, n), dur)
    storm = (ts > 300) & (ts < 330)
    hit = storm & (kind == 1) & (rng.random(n) < 0.4)
    dur = np.where(hit, dur + rng.uniform(15e6, 40e6, n), dur)
    dur = np.where(storm & (kind == 2), rng.uniform(5e6, 30e6, n), dur)
    arg0 = np.where(kind == 3, 256, 0)
    pid = np.where(kind == 3, 281, 4242)
    tsn = (BASE + ts * 1e9).astype(np.int64)
    rows = list(
        zip(
            tsn.tolist(),
            pid.tolist(),
            pid.tolist(),
            src.tolist(),
            op.tolist(),
            dur.astype(np.int64).tolist(),
            [0] * n,
            arg0.tolist(),
            [0] * n,
            [0] * n,
            [0] * n,
            [0] * n,
            strict=True,
        )
    )
    with StoreWriter(path, Identity("bench-node")) as w:
        sid = w.start_session({}, started_at=int(tsn[0]))
        for i in range(0, n, 100_000):
            w.write_batch(rows[i : i + 100_000])
        w.end_session(sid, stopped_at=int(tsn[-1]))


def best_of(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--events", type=int, default=None)
    args = ap.parse_args()
    n = args.events or (200_000 if args.quick else 1_000_000)
    repeat = 2 if args.quick else 3
    threads = read_threads()  # what `ingero explain --db` uses on this machine
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        t = time.perf_counter()
        make_db(db, n)
        print(f"built {n:,}-event database in {time.perf_counter() - t:.1f}s")
        conn = open_readonly(db)

        def cursor_rows() -> None:  # the same per-row columns the frames hold, fetched as row tuples
            dt = np.dtype([(c, np.int64) for c in ("s", "o", "d", "t", "p", "e")])
            sql = "SELECT source, op, duration, timestamp, pid, ret_code != 0 FROM events"
            np.fromiter(conn.execute(sql), dtype=dt)

        t_cursor = best_of(cursor_rows, repeat)
        t_frames = best_of(lambda: load_frames(conn), repeat)
        t_stats = best_of(lambda: op_stats(conn), repeat)
        tracemalloc.start()
        report = explain(conn)
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20  # numpy arrays and the fetched strings
        tracemalloc.stop()
        t_serial = best_of(lambda: explain(conn), repeat)
        t_explain = best_of(lambda: explain(conn, threads=threads), repeat)
        conn.close()
    print(f"cursor fetch of 6 columns (baseline)   {t_cursor:6.2f} s")
    print(
        f"frame load (same columns + arg rows)   {t_frames:6.2f} s   {t_cursor / t_frames:4.1f}x faster than baseline"
    )
    print(f"op_stats                               {t_stats:6.2f} s")
    print(f"explain, one connection (the agent API) {t_serial:5.2f} s")
    print(
        f"explain, {threads} reading threads (the CLI)   {t_explain:5.2f} s   target <= {TARGET_S:.1f} s: "
        f"{'met' if t_explain <= TARGET_S else 'NOT met'} ({t_explain / TARGET_S:.2f} of target) "
        f"at {n / t_explain / 1e6:.2f} M events/s"
    )
    print(f"explain / cursor fetch of 6 columns    {t_explain / t_cursor:6.2f}x  (v1: ~1.45x)")
    print(f"explain's peak memory (tracemalloc)    {peak_mb:6.0f} MB  ({peak_mb * 2**20 / n:.0f} bytes/event)")
    print(f"chains found: {[(c.severity, c.family, c.cuda_op) for c in report.chains]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
