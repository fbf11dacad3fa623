"""Agent API overhead: the seed query through ``POST /api/v1/query`` (TLS 1.3, httpx) versus the same SQL
run with sqlite3 directly, on a 1 M-event database written by the real StoreWriter (target ≤ 1.2x).

Measured side by side in one run, interleaved (direct, API, direct, API, ...), medians reported:
  direct   sqlite3.connect(db) + execute + fetchall of the seed query, one fresh connection per run
  api      the same SQL through a running agent: TLS 1.3 (self-signed cert), the SQL guard (read-only
           connection, authorizer, progress-handler deadline, row cap), a worker thread, JSON both ways
  tiny     ``SELECT 1`` through the API: the fixed cost of one request (reported in ms, no target)

The database is cached under $TMPDIR/ingero-bench/ (rebuilt when missing or of another size).

Usage: .venv/bin/python bench/bench_api.py [--events N] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import queue
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import trio
from verdict import Target, no_verdict, summary, verdict

from ingero.agent.api.server import BoundServer, ServerSettings, serve_api
from ingero.identity import Identity
from ingero.store.budget import QueryBudget
from ingero.store.writer import EventRow, StoreWriter
from ingero.tls.context import client_ssl_context

SEED_QUERY = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
TARGET = Target(1.2, "x")
TARGET_EVENTS = 1_000_000  # the database size the target is set on


def build_db(path: Path, n: int) -> Path:
    """n events of a realistic mix (CUDA/driver calls, sched_switch, block I/O) through StoreWriter."""
    wal = Path(str(path) + "-wal")
    if path.exists() and not (wal.exists() and wal.stat().st_size > 0):  # a non-empty WAL: a crashed build
        try:
            conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)  # creates no -wal/-shm beside it
            have = conn.execute("SELECT count(*) FROM events").fetchone()[0]
            conn.close()
            if have == n:
                return path
        except sqlite3.Error:
            pass
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {path} with {n:,} events (cached for later runs) ...", file=sys.stderr)
    rng = random.Random(11)
    kinds = [(1, 3), (1, 1), (4, 1), (3, 1), (3, 1), (5, 2), (1, 5), (5, 1)]
    t = 1_775_218_723_000_000_000
    with StoreWriter(path, Identity("bench-node", rank=0, local_rank=0, world_size=1)) as w:
        sid = w.start_session({"flags": "bench"})
        batch: list[EventRow] = []
        for i in range(n):
            t += rng.randint(500, 5000)
            source, op = kinds[i % len(kinds)]
            pid = 4000 + i % 3
            batch.append(
                (t, pid, pid + i % 7, source, op, rng.randint(1000, 900_000), 0, rng.randint(0, 1 << 30), 0, 0, 0, 0)
            )
            if len(batch) == 50_000:
                w.write_batch(batch)
                batch = []
        if batch:
            w.write_batch(batch)
        w.end_session(sid, {"events_seen": n})
    return path


@contextmanager
def agent(db: Path, tls_dir: Path) -> Iterator[BoundServer]:
    """A real agent in a background thread's trio loop (the client below is a separate, blocking httpx)."""
    ready: queue.Queue[BoundServer | BaseException] = queue.Queue()
    stop: list[trio.CancelScope] = []
    token: list[trio.lowlevel.TrioToken] = []

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())
        try:
            async with trio.open_nursery() as n:
                stop.append(n.cancel_scope)
                s = ServerSettings(
                    db_path=db,
                    identity=Identity("bench-node"),
                    port=0,
                    tls_dir=tls_dir,
                    budget=QueryBudget(max_timeout_ms=60_000),
                )
                ready.put(await n.start(serve_api, s))
        except BaseException as e:
            ready.put(e)
            raise

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    got = ready.get(timeout=60)
    if isinstance(got, BaseException):
        raise SystemExit(f"agent failed to start: {got!r}")
    try:
        yield got
    finally:
        trio.from_thread.run_sync(stop[0].cancel, trio_token=token[0])
        thread.join(30)


def run_direct(db: Path) -> tuple[float, list[tuple[object, ...]]]:
    t0 = time.perf_counter()
    conn = sqlite3.connect(str(db))
    rows = conn.execute(SEED_QUERY).fetchall()
    conn.close()
    return time.perf_counter() - t0, rows


def run_api(client: httpx.Client, sql: str) -> tuple[float, dict[str, object]]:
    t0 = time.perf_counter()
    r = client.post("/api/v1/query", json={"sql": sql, "timeout_ms": 60_000})
    doc = r.json()
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"API error {r.status_code}: {doc}")
    return dt, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=TARGET_EVENTS)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="100 k events, 3 repetitions (smoke run: no verdict)")
    args = ap.parse_args()
    if args.quick:
        args.events, args.repeat = 100_000, 3
    cache = Path(tempfile.gettempdir()) / "ingero-bench"
    db = build_db(cache / f"api-{args.events}.db", args.events)

    with tempfile.TemporaryDirectory() as tmp, agent(db, Path(tmp) / "tls") as bound:
        ctx = client_ssl_context(ca_cert=Path(tmp) / "tls" / "server-cert.pem")
        with httpx.Client(base_url=bound.url, verify=ctx, timeout=120) as client:
            # warm both paths (page cache, connection, TLS session) and check they agree
            _, direct_rows = run_direct(db)
            _, doc = run_api(client, SEED_QUERY)
            api_rows = doc["rows"]
            agree = isinstance(api_rows, list) and [list(r[:3]) for r in direct_rows] == [r[:3] for r in api_rows]
            direct, api, tiny = [], [], []
            for _ in range(args.repeat):
                direct.append(run_direct(db)[0])
                api.append(run_api(client, SEED_QUERY)[0])
                tiny.append(run_api(client, "SELECT 1")[0])

    d_ms, a_ms, t_ms = (statistics.median(x) * 1000 for x in (direct, api, tiny))
    ratio = a_ms / d_ms
    print(
        f"agent API overhead, seed query on {args.events:,} events ({len(direct_rows)} result rows), median of {args.repeat}"
    )
    print(f"  sqlite3 direct   {d_ms:9.1f} ms   (min {min(direct) * 1000:.1f})")
    print(f"  API (TLS 1.3)    {a_ms:9.1f} ms   (min {min(api) * 1000:.1f})")
    print(f"  API 'SELECT 1'   {t_ms:9.2f} ms   fixed cost of one request")
    agreement = "API and sqlite3 rows agree" if agree else "API and sqlite3 rows DISAGREE"
    if args.events >= TARGET_EVENTS:
        verdict("API / sqlite3 direct, seed query", ratio, TARGET, complete=agree, detail=agreement)
    else:
        no_verdict(
            "API / sqlite3 direct, seed query", ratio, TARGET, f"target on {TARGET_EVENTS:,} events", detail=agreement
        )
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
