"""The fleet's history in ClickHouse, on a real 2-shard cluster (two ``clickhouse-server`` processes on
127.0.0.1, tests/clickhouse_cluster.py):

  ship     one agent's recording (N events, written through the real writer) shipped by ``Shipper``
           through server 1 into the Distributed tables: events/s, and the shipper's CPU per event
           (this process: SQLite read + formatting + HTTP; ClickHouse's own CPU is not in it)
                                                                       (target: >= 200,000 events/s)
  query    the seed query over AGENTS nodes x EVENTS events (10 M rows at full size: each node's rows are
           the same recording under its own name, copied inside ClickHouse) through a Distributed table
           with ``ingero.clickhouse.query.run_query`` (readonly=1), median of --repeat
  fan-out  the same seed query fanned out by ``fleet_query`` to AGENTS real mTLS agents, each over its own
           copy of that recording (bench/bench_fleet.py's agents), in the same run: ClickHouse / fan-out

Every figure is checked: the store holds exactly the shipped events; the query's per-node counts are the
recording's, for every node; every agent answers. Otherwise the verdict is MISS.

Usage: .venv/bin/python bench/bench_clickhouse.py [--quick] [--events N] [--agents N] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdict import Target, no_verdict, summary, verdict

from tests.clickhouse_cluster import SERVER_BIN, Server, local_cluster

SQL = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
SHIP_RATE = Target(200_000, " events/s", at_least=True, fmt="{:,.0f}")
FULL_SHIP_EVENTS = 1_000_000
FULL_AGENTS, PER_AGENT = 1000, 10_000
BASE_NS = 1_800_000_000 * 10**9
FILL_CHUNK = 100  # nodes per INSERT … SELECT when filling the store


def write_recording(db: Path, events: int, node: str) -> None:
    """``events`` events through the real writer: CUDA, driver and host ops over 8 threads of one process."""
    from ingero.identity import Identity
    from ingero.store.catalog import op_id
    from ingero.store.writer import StoreWriter

    ops = [
        op_id(n) for n in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSync", "cuLaunchKernel", "sched_switch")
    ]
    rng = random.Random(1)
    step = 100_000
    with StoreWriter(db, Identity(node)) as w:
        for k in range(0, events, step):
            rows = []
            for i in range(min(step, events - k)):
                source, op = ops[i % len(ops)]
                rows.append(
                    (
                        BASE_NS + (k + i) * 1000,
                        4242,
                        4242 + i % 8,
                        source,
                        op,
                        rng.randrange(1000, 100_000),
                        0,
                        rng.randrange(1 << 30),
                        0,
                        0,
                        0,
                        0,
                    )
                )
            w.write_batch(rows)


def bench_ship(url: str, db: Path, events: int, quick: bool) -> None:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.shipper import Shipper

    with ClickHouse(url) as ch, Shipper(db, ch) as sh:
        c0, t0 = time.process_time(), time.perf_counter()
        result = sh.ship_once()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stored = int(ch.select("SELECT count() FROM events").rows[0][0])
    shipped = result.tables["events"].rows
    rate = shipped / wall
    print(
        f"ship: {shipped:,} events in {wall:.2f} s = {rate:,.0f} events/s; shipper CPU {cpu:.2f} s = {cpu / shipped * 1e6:.2f} µs/event"
    )
    name = "ship rate, one agent into the 2-shard cluster"
    complete = stored == shipped == events
    if quick:
        no_verdict(name, rate, SHIP_RATE, f"quick run ({events:,} events)")
    else:
        verdict(name, rate, SHIP_RATE, complete=complete, detail=f"{stored:,} of {events:,} events in the store")


def fill_store(servers: list[Server], agents: int) -> None:
    """Every node's rows: the recording in ``events_src`` (server 1) under ``agent-NNNN`` names, written by
    each server into its own shard's table for the nodes the Distributed table's key sends there
    (``sipHash64(node) % 2``): what shipping each node would have done, at ClickHouse's own speed."""
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.schema import BY_NAME, SHARDING_KEY

    cols = [c.name for c in BY_NAME["events"].columns]
    name = "concat('agent-', substring(toString(10000 + k), 2))"  # zero-padded (18.16 has no leftPad)
    sel = ", ".join(f"{name} AS node" if c == "node" else f"`{c}`" for c in cols)
    src = f"remote('127.0.0.1:{servers[0].tcp}', default, events_src)"
    for shard, server in enumerate(servers):
        with ClickHouse(server.url, timeout_s=600) as ch:
            ch.execute("TRUNCATE TABLE IF EXISTS events_local")
            for lo in range(0, agents, FILL_CHUNK):  # ~1 M rows per insert: within the servers' memory limit
                nodes = f"arrayMap(x -> x + {lo}, range({min(FILL_CHUNK, agents - lo)}))"
                ch.execute(
                    f"INSERT INTO events_local ({', '.join(cols)}) SELECT * FROM (SELECT {sel} FROM {src} "
                    f"ARRAY JOIN {nodes} AS k) WHERE {SHARDING_KEY} % {len(servers)} = {shard}"
                )


def bench_query(urls: list[str], agents: int, per_agent: int, repeat: int) -> tuple[float, bool]:
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.query import READONLY_SETTINGS, run_query

    times, ok = [], True
    with ClickHouse(urls[1], settings=READONLY_SETTINGS) as ch:
        for _ in range(repeat):
            t0 = time.perf_counter()
            res = run_query(ch, SQL, limit=10_000, timeout_ms=60_000)
            times.append(time.perf_counter() - t0)
            per_node: dict[str, int] = {}
            for node, _source, cnt, _avg in res.rows:
                per_node[node] = per_node.get(node, 0) + int(cnt)
            ok = ok and not res.truncated and len(per_node) == agents and set(per_node.values()) == {per_agent}
    med = statistics.median(times)
    print(
        f"query: the seed query over {agents:,} nodes x {per_agent:,} events through a Distributed table: median {med * 1000:.0f} ms of {repeat}"
    )
    return med, ok


def bench_fanout(db: Path, agents: int, tmp: Path) -> tuple[float, bool]:
    import bench_fleet

    pki = tmp / "pki"
    bench_fleet.make_pki(pki)
    bench_fleet.raise_fd_limit()
    rows_each = bench_fleet.expected_rows(db)
    t0 = time.perf_counter()
    pool = bench_fleet.start_agents(agents, max(4, agents // 250), db, pki)
    print(f"fan-out: {agents} agents started in {time.perf_counter() - t0:.1f} s")
    try:
        run = bench_fleet.run_fleet(pool.nodes, pki, rows_each)
    finally:
        pool.close()
    ok = run.counts["answered"] == agents and run.counts["rows"] == agents
    print(f"fan-out: fleet_query to {agents} agents {run.wall:.2f} s ({run.counts}; {run.failures[:1]})")
    return run.wall, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 200 k events shipped, 100 agents")
    ap.add_argument("--events", type=int, help=f"events shipped (default {FULL_SHIP_EVENTS:,})")
    ap.add_argument("--agents", type=int, help=f"nodes for the query (default {FULL_AGENTS:,}; 0: skip)")
    ap.add_argument("--per-agent", type=int, default=PER_AGENT, help=f"events per node (default {PER_AGENT:,})")
    ap.add_argument("--repeat", type=int, default=5, help="query runs (median)")
    ap.add_argument("--no-fanout", action="store_true", help="skip the fan-out side (ClickHouse figure only)")
    args = ap.parse_args()
    if SERVER_BIN is None:
        print("clickhouse-server is not installed (apt-get install clickhouse-server)")
        return 2
    events = args.events or (200_000 if args.quick else FULL_SHIP_EVENTS)
    agents = args.agents if args.agents is not None else (100 if args.quick else FULL_AGENTS)
    tmp = Path(tempfile.mkdtemp(prefix="ingero-bench-clickhouse-"))
    print(f"ClickHouse history: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    try:
        with local_cluster(tmp / "cluster") as servers:
            urls = [s.url for s in servers]
            big = tmp / "agent.db"
            write_recording(big, events, "agent-ship")
            bench_ship(urls[0], big, events, args.quick)
            if not agents:
                return summary()
            small = tmp / "node.db"
            write_recording(small, args.per_agent, "agent-src")
            from ingero.clickhouse.client import ClickHouse
            from ingero.clickhouse.schema import BY_NAME, local_ddl
            from ingero.clickhouse.shipper import Shipper

            with ClickHouse(urls[0]) as ch:  # the recording as shipped, kept aside on server 1
                ch.execute(local_ddl(BY_NAME["events"], "default").replace("events_local", "events_src"))
                with Shipper(small, ch) as sh:
                    sh.ship_once()
                ch.execute("INSERT INTO events_src SELECT * FROM events WHERE node = 'agent-src'")
            t0 = time.perf_counter()
            fill_store(servers, agents)
            print(f"store: {agents * args.per_agent:,} rows copied in {time.perf_counter() - t0:.1f} s")
            ch_s, ch_ok = bench_query(urls, agents, args.per_agent, args.repeat)
        name = f"seed query, {agents:,} nodes x {args.per_agent:,} events: ClickHouse / fan-out"
        if args.no_fanout:
            no_verdict(
                f"seed query over {agents:,} nodes through ClickHouse",
                ch_s * 1000,
                Target(1e9, " ms", fmt="{:.0f}"),
                "no fan-out side",
            )
            return summary()
        fan_s, fan_ok = bench_fanout(small, agents, tmp)
        ratio = ch_s / fan_s
        print(f"seed query: ClickHouse {ch_s:.2f} s, fan-out {fan_s:.2f} s ({ratio:.2f}x)")
        target = Target(1.0, "x")
        if args.quick:
            no_verdict(name, ratio, target, f"quick run ({agents} nodes)")
        else:
            verdict(
                name,
                ratio,
                target,
                complete=ch_ok and fan_ok,
                detail=f"ClickHouse counts exact: {ch_ok}; every agent answered: {fan_ok}",
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
