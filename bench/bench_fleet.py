"""Fleet fan-out: wall time and client CPU of ``fleet_query`` (TLS 1.3 + mTLS, clock skew, merge) against a
minimal raw httpx fan-out to the same agents, for 4, 32 and 128 agents; then 1,000 agents.

Agents are real ``serve_api`` listeners (hypercorn, mTLS with ingero's PKI), each over its own copy of
an Ingero sample database (its own file: its own instance, as on real nodes), many listeners per
process, spread over a few agent processes started by this script (``--child`` mode); each process
reports its bound ports on stdout once listening.

Measured side by side, alternating, fresh connections every run:
  fleet      ingero.fleet.fleet_query(nodes, settings, SQL): one trio task per node under a
             CapacityLimiter(64), per-node deadline, the query (its answer carries a clock sample in
             headers) and one /time sample concurrently, the shared answer budget, outcome
             classification, rows merged under 'node'
  raw        the minimum that does the same exchanges with httpx: one ``httpx.AsyncClient`` per node
             (its own pool, HTTP/1.1) over one shared SSL context (no certifi load), the same limiter
             width, POST /api/v1/query then one GET /api/v1/time on that connection, json decoding —
             no classification, no skew, no merge                       (target: fleet / raw <= 1.1x)
  raw-query  raw without the /time sample (shown for scale)
  cpu/node   this process's CPU time (user + system; the agents run in child processes) per node
             (target: fleet <= 3 ms per node at 128 agents)
1,000 agents: fleet_query wall time against raw on the same agents (target <= 1.1x), client CPU (target
<= 3.5 s) and this process's peak RSS (target < 300 MB).

Every node must answer on both sides: fleet with its rows (each node's full result under its name in
the merged table) and a skew estimate, raw with the query and the /time sample. A node that fails or
times out on either side makes that size's verdicts MISS (incomplete), with the counts.

Usage: .venv/bin/python bench/bench_fleet.py [--quick] [--repeat N] [--thousand N] [--procs N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sqlite3
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verdict import Target, no_verdict, summary, verdict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import trio

from ingero.config import NodeSpec

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DB = ROOT / "tests" / "data" / "ingero-samples" / "sample-gpu-node-02.db"
SQL = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
RATIO = Target(1.1, "x")
CPU_PER_NODE = Target(3.0, " ms", fmt="{:.2f}")
CPU_AT = 128  # agents at which the per-node CPU target holds
THOUSAND_CPU = Target(3.5, " s")
RSS = Target(300, " MB", strict=True, fmt="{:.0f}")
SAMPLES = 2  # skew_samples: the query's own header sample + one /time round trip
RAW_TIME_SAMPLES = 1  # the raw client's /time round trips (the same exchanges as fleet's)
WIDTH = 64
NODE_TIMEOUT_S = 30.0  # per node, both clients


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def expected_rows(db: Path) -> int:
    """Rows SQL gives on one agent's database: what every node must contribute to the merged table."""
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        return len(conn.execute(SQL).fetchall())
    finally:
        conn.close()


# --- agent processes --------------------------------------------------------------------------------


def agent_db(dbs: Path, i: int) -> Path:
    return dbs / f"agent-{i:04d}.db"


def child_main(count: int, dbs: Path, pki: Path, first: int) -> None:
    """``--child``: serve ``count`` mTLS listeners on 127.0.0.1, print their ports, run until stdin closes."""
    raise_fd_limit()
    from ingero.agent.api.server import ServerSettings, serve_api
    from ingero.identity import Identity

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ports = []
            for i in range(first, first + count):
                settings = ServerSettings(
                    db_path=agent_db(dbs, i),
                    identity=Identity(f"bench-{i:04d}"),
                    host="127.0.0.1",
                    port=0,
                    tls_cert=pki / "node-bench.pem",
                    tls_key=pki / "node-bench-key.pem",
                    client_ca=pki / "ca.pem",
                )
                bound = await nursery.start(serve_api, settings)
                ports.append(bound.port)
            print(json.dumps(ports), flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # the parent closes stdin to stop us
            nursery.cancel_scope.cancel()

    trio.run(main)


@dataclass
class AgentPool:
    procs: list[subprocess.Popen[str]]
    nodes: list[NodeSpec]

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_agents(total: int, procs: int, db: Path, pki: Path) -> AgentPool:
    """``total`` agents named bench-0000... over ``procs`` processes, each agent over its own copy of ``db``."""
    dbs = db.parent / f"{db.stem}-agents"
    dbs.mkdir(exist_ok=True)
    for i in range(total):
        if not agent_db(dbs, i).exists():
            shutil.copy(db, agent_db(dbs, i))
    per = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    started: list[subprocess.Popen[str]] = []
    first = 0
    for count in per:
        cmd = [sys.executable, __file__, "--child", str(count), "--db", str(dbs), "--pki", str(pki)]
        cmd += ["--first", str(first)]
        started.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first += count
    nodes: list[NodeSpec] = []
    pool = AgentPool(started, nodes)
    for p in started:
        assert p.stdout is not None
        line = p.stdout.readline()  # the child's readiness report
        if not line:
            pool.close()
            raise RuntimeError(f"agent process {p.pid} exited before listening (rc={p.returncode})")
        nodes.extend(NodeSpec("127.0.0.1", port) for port in json.loads(line))
    return pool


def make_pki(d: Path) -> None:
    """A CA, the agents' certificate (node-bench) and the client's (client-bench) in ``d``."""
    from ingero.tls.pki import create_ca, issue_cert, split_sans

    create_ca(d)
    issue_cert(d, "node", "bench", split_sans(["127.0.0.1", "localhost"]))
    issue_cert(d, "client", "bench")


CLIENT_TLS = {"--ca-cert": "ca.pem", "--client-cert": "client-bench.pem", "--client-key": "client-bench-key.pem"}


def tls_flags(pki: Path) -> list[str]:
    """The CLI's mTLS flags for :func:`make_pki`'s client."""
    return [x for flag, name in CLIENT_TLS.items() for x in (flag, str(pki / name))]


# --- the two clients ------------------------------------------------------------------------------


@dataclass
class Run:
    """One fan-out: wall time, this process's CPU, and how many nodes did each part of the exchange."""

    wall: float
    cpu: float
    counts: dict[str, int]  # e.g. {"answered": 128, "rows": 128, "skew": 128}
    failures: list[str] = field(default_factory=list)  # the first few nodes' reasons


def fleet_settings(pki: Path, samples: int = SAMPLES) -> Any:
    from ingero.fleet.settings import ClientSettings

    return ClientSettings(
        ca_cert=str(pki / CLIENT_TLS["--ca-cert"]),
        client_cert=str(pki / CLIENT_TLS["--client-cert"]),
        client_key=str(pki / CLIENT_TLS["--client-key"]),
        timeout_s=NODE_TIMEOUT_S,
        fanout=WIDTH,
        skew_samples=samples,
    )


def cpu_s() -> float:
    """This process's CPU time, user + system (the agents are child processes)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_fleet(nodes: list[NodeSpec], pki: Path, rows_each: int) -> Run:
    """One fleet_query: answered nodes, nodes whose full result is in the merged table, skew estimates."""
    from ingero.fleet.operations import fleet_query

    settings = fleet_settings(pki)

    async def main() -> Any:
        return await fleet_query(nodes, settings, SQL)

    c0, t0 = cpu_s(), time.perf_counter()
    result = trio.run(main)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    node_col = result.columns.index("node") if "node" in result.columns else None
    per_node: dict[Any, int] = {}
    for row in result.rows if node_col is not None else []:
        per_node[row[node_col]] = per_node.get(row[node_col], 0) + 1
    counts = {
        "answered": len(result.answered),
        "rows": sum(1 for k in per_node.values() if k == rows_each),
        "skew": sum(1 for o in result.outcomes if o.skew is not None),
    }
    failures = [f"{o.display}: {o.kind} {o.reason}" for o in result.failed][:3]
    return Run(wall, cpu, counts, failures)


def run_raw(nodes: list[NodeSpec], pki: Path, samples: int) -> Run:
    """The raw httpx fan-out; every node's failure (timeout included) is counted, never dropped."""
    counts = {"answered": 0, "time": 0}
    failures: list[str] = []

    async def one(node: NodeSpec, ctx: ssl.SSLContext, limiter: trio.CapacityLimiter, body: bytes) -> None:
        async with limiter:
            try:
                with trio.fail_after(NODE_TIMEOUT_S):
                    async with httpx.AsyncClient(
                        base_url=f"https://{node.host}:{node.port}", verify=ctx, http1=True, http2=False, timeout=None
                    ) as client:
                        r = await client.post(
                            "/api/v1/query", content=body, headers={"content-type": "application/json"}
                        )
                        if r.status_code == 200 and json.loads(r.content).get("ok"):
                            counts["answered"] += 1
                        for _ in range(samples):
                            t1 = time.time_ns()
                            doc = json.loads((await client.get("/api/v1/time")).content)
                            _ = (doc["receive_ns"] - t1, time.time_ns())
                        counts["time"] += 1 if samples else 0
            except (trio.TooSlowError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
                failures.append(f"{node.host}:{node.port}: {type(e).__name__} {e}")

    async def main() -> None:
        ctx = ssl.create_default_context(cafile=str(pki / CLIENT_TLS["--ca-cert"]))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(pki / CLIENT_TLS["--client-cert"]), str(pki / CLIENT_TLS["--client-key"]))
        ctx.set_alpn_protocols(["http/1.1"])
        limiter = trio.CapacityLimiter(WIDTH)
        body = json.dumps({"sql": SQL}).encode()
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node, ctx, limiter, body)

    c0, t0 = cpu_s(), time.perf_counter()
    trio.run(main)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    if not samples:
        del counts["time"]
    return Run(wall, cpu, counts, failures[:3])


def completeness(n: int, runs: dict[str, list[Run]]) -> tuple[bool, str]:
    """Whether every node did every part of every run of every client; the lowest counts as detail."""
    low: dict[str, int] = {}
    failures: list[str] = []
    for client, client_runs in runs.items():
        for r in client_runs:
            for k, v in r.counts.items():
                low[f"{client} {k}"] = min(low.get(f"{client} {k}", n), v)
            failures += r.failures
    detail = ", ".join(f"{k} {v}/{n}" for k, v in low.items())
    complete = all(v == n for v in low.values())
    return complete, detail + (f"; e.g. {failures[0]}" if failures else "")


# --- the run ----------------------------------------------------------------------------------------


def bench_sizes(pool: AgentPool, sizes: list[int], repeat: int, pki: Path, rows_each: int) -> None:
    print(f"{'agents':>7} {'fleet ms':>9} {'raw ms':>8} {'raw-query ms':>13} {'cpu/node fleet':>15} {'raw':>8}")
    for n in sizes:
        nodes = pool.nodes[:n]
        run_fleet(nodes, pki, rows_each)  # warm-up (imports, first handshakes on each listener)
        run_raw(nodes, pki, RAW_TIME_SAMPLES)
        fleet: list[Run] = []
        raw: list[Run] = []
        rawq: list[Run] = []
        for _ in range(repeat):
            fleet.append(run_fleet(nodes, pki, rows_each))
            raw.append(run_raw(nodes, pki, RAW_TIME_SAMPLES))
            rawq.append(run_raw(nodes, pki, 0))
        f, r, q = (statistics.median(x.wall for x in runs) * 1000 for runs in (fleet, raw, rawq))
        fc, rc = (statistics.median(x.cpu for x in runs) / n * 1000 for runs in (fleet, raw))
        print(f"{n:>7} {f:>9.1f} {r:>8.1f} {q:>13.1f} {fc:>12.2f} ms {rc:>5.2f} ms")
        complete, detail = completeness(n, {"fleet": fleet, "raw": raw, "raw-query": rawq})
        verdict(f"{n} agents: fleet / raw wall (median of {repeat})", f / r, RATIO, complete=complete, detail=detail)
        if n == CPU_AT:
            verdict(f"{n} agents: fleet client CPU per node", fc, CPU_PER_NODE, complete=complete)
        else:
            no_verdict(f"{n} agents: fleet client CPU per node", fc, CPU_PER_NODE, f"target at {CPU_AT} agents")


def bench_big(big: int, procs: int, db: Path, pki: Path, rows_each: int, quick: bool) -> None:
    t0 = time.perf_counter()
    pool = start_agents(big, max(procs, big // 250), db, pki)
    startup = time.perf_counter() - t0
    try:
        fleet = run_fleet(pool.nodes, pki, rows_each)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        raw = run_raw(pool.nodes, pki, RAW_TIME_SAMPLES)
        rawq = run_raw(pool.nodes, pki, 0)
    finally:
        pool.close()
    print(
        f"{big} agents ({len(pool.procs)} processes, started in {startup:.1f} s): fleet_query {fleet.wall:.2f} s, "
        f"raw {raw.wall:.2f} s, raw-query {rawq.wall:.2f} s — the agents share this machine's {os.cpu_count()} "
        "CPUs with the client, so their TLS handshakes and queries set the floor"
    )
    complete, detail = completeness(big, {"fleet": [fleet], "raw": [raw], "raw-query": [rawq]})
    verdict(f"{big} agents: fleet / raw wall", fleet.wall / raw.wall, RATIO, complete=complete, detail=detail)
    cpu_name, rss_name = f"{big} agents: fleet client CPU", f"{big} agents: client peak RSS"
    if quick:
        no_verdict(cpu_name, fleet.cpu, THOUSAND_CPU, "quick run: target at 1,000 agents")
        no_verdict(rss_name, rss_mb, RSS, "quick run: target at 1,000 agents")
    else:
        verdict(cpu_name, fleet.cpu, THOUSAND_CPU, complete=complete and big >= 1000, detail=f"{big} agents")
        verdict(rss_name, rss_mb, RSS, complete=complete and big >= 1000, detail=f"{big} agents")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 4, 32, 128 agents, one repeat, 200 for the big run"
    )
    ap.add_argument("--repeat", type=int, default=5, help="runs per client and size (median reported)")
    ap.add_argument("--thousand", type=int, default=1000, help="agents for the large run (0: skip)")
    ap.add_argument("--procs", type=int, default=4, help="agent processes")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child, args.db, args.pki, args.first)
        return 0
    raise_fd_limit()
    sizes = [4, 32, 128]
    repeat = 1 if args.quick else args.repeat
    big = min(args.thousand, 200) if args.quick else args.thousand
    tmp = Path(tempfile.mkdtemp(prefix="ingero-bench-fleet-"))
    try:
        pki = tmp / "pki"
        make_pki(pki)
        db = tmp / "agent.db"
        shutil.copy(SAMPLE_DB, db)
        db.chmod(0o644)
        rows_each = expected_rows(db)
        print(
            f"fleet fan-out: {SQL!r} ({rows_each} rows per node), width {WIDTH}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        pool = start_agents(max(sizes), min(args.procs, max(sizes)), db, pki)
        try:
            bench_sizes(pool, sizes, repeat, pki, rows_each)
        finally:
            pool.close()
        if big:
            bench_big(big, args.procs, db, pki, rows_each, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
