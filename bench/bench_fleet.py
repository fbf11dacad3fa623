"""Fleet fan-out: wall time and client CPU of ``fleet_query`` (TLS 1.3 + mTLS, clock skew, merge) against a
minimal raw trio-TLS fan-out to the same agents, for 4, 32 and 128 agents; then 1,000 agents.

Agents are real ``serve_api`` listeners (hypercorn, mTLS with ingero's PKI) over a copy of an Ingero
sample database, many listeners per process, spread over a few agent processes started by this script
(``--child`` mode); each process reports its bound ports on stdout once listening.

Measured side by side, alternating, fresh connections every run:
  fleet      ingero.fleet.fleet_query(nodes, settings, SQL): one h11 transport and SSL context, one trio
             task per node under a CapacityLimiter(64), per-node deadline, the query (its answer carries a
             clock sample in headers) and one /time sample concurrently, the shared answer budget,
             outcome classification, rows merged under 'node'
  raw        the minimum that does the same exchanges: trio.open_ssl_over_tcp_stream per node (same
             limiter width), a hand-written HTTP/1.1 POST /api/v1/query and one GET /api/v1/time on that
             one connection, Content-Length framing, json.loads — no pool, no classification, no merge
             (target: fleet / raw <= 1.1x at 128 agents)
  raw-query  raw without the /time sample (shown for scale)
  cpu/node   this process's CPU time (user + system; the agents run in child processes) per node
             (target: fleet <= 3 ms per node)
1,000 agents: fleet_query wall time against raw on the same agents (target <= 1.1x), client CPU (target
<= 3 s) and this process's peak RSS (target < 300 MB).

Usage: .venv/bin/python bench/bench_fleet.py [--quick] [--repeat N] [--thousand N] [--procs N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio

from ingero.config import NodeSpec

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DB = ROOT / "tests" / "data" / "ingero-samples" / "sample-gpu-node-02.db"
SQL = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
TARGET_RATIO = 1.1
TARGET_CPU_MS_PER_NODE = 3.0
TARGET_1000_CPU_S = 3.0
TARGET_RSS_MB = 300
SAMPLES = 2  # skew_samples: the query's own header sample + one /time round trip
RAW_TIME_SAMPLES = 1  # the raw client's /time round trips (the same exchanges as fleet's)
WIDTH = 64


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- agent processes --------------------------------------------------------------------------------


def child_main(count: int, db: Path, pki: Path, first: int) -> None:
    """``--child``: serve ``count`` mTLS listeners on 127.0.0.1, print their ports, run until stdin closes."""
    raise_fd_limit()
    from ingero.api.server import ServerSettings, serve_api
    from ingero.identity import Identity

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ports = []
            for i in range(count):
                settings = ServerSettings(
                    db_path=db,
                    identity=Identity(f"bench-{first + i:04d}"),
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
    per = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    started: list[subprocess.Popen[str]] = []
    first = 0
    for count in per:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(count),
            "--db",
            str(db),
            "--pki",
            str(pki),
            "--first",
            str(first),
        ]
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
    from ingero.tls.pki import create_ca, issue_cert, split_sans

    create_ca(d)
    issue_cert(d, "node", "bench", split_sans(["127.0.0.1", "localhost"]))
    issue_cert(d, "client", "bench")


# --- the two clients ------------------------------------------------------------------------------


def fleet_settings(pki: Path, samples: int = SAMPLES) -> Any:
    from ingero.fleet.settings import ClientSettings

    return ClientSettings(
        ca_cert=str(pki / "ca.pem"),
        client_cert=str(pki / "client-bench.pem"),
        client_key=str(pki / "client-bench-key.pem"),
        timeout_s=30.0,
        fanout=WIDTH,
        skew_samples=samples,
    )


def cpu_s() -> float:
    """This process's CPU time, user + system (the agents are child processes)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_fleet(nodes: list[NodeSpec], pki: Path) -> tuple[float, int, int, float]:
    """Wall time, answered, skew estimates and this process's CPU seconds of one fleet_query."""
    from ingero.fleet.operations import fleet_query

    settings = fleet_settings(pki)

    async def main() -> tuple[float, int, int]:
        t0 = time.perf_counter()
        result = await fleet_query(nodes, settings, SQL)
        wall = time.perf_counter() - t0
        skewed = sum(1 for o in result.outcomes if o.skew is not None)
        return wall, len(result.answered), skewed

    c0 = cpu_s()
    wall, answered, skewed = trio.run(main)
    return wall, answered, skewed, cpu_s() - c0


async def _read_response(stream: trio.SSLStream[trio.SocketStream], buf: bytearray) -> bytes:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) >= 0 else None])
            if len(buf) >= end + 4 + length:
                body = bytes(buf[end + 4 : end + 4 + length])
                del buf[: end + 4 + length]
                return body
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk


def run_raw(nodes: list[NodeSpec], pki: Path, samples: int) -> tuple[float, int, int]:
    async def main() -> tuple[float, int, int]:
        t0 = time.perf_counter()
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(pki / "client-bench.pem"), str(pki / "client-bench-key.pem"))
        ctx.set_alpn_protocols(["http/1.1"])
        limiter = trio.CapacityLimiter(WIDTH)
        answered = [0]
        timed = [0]
        body = json.dumps({"sql": SQL}).encode()

        async def one(node: NodeSpec) -> None:
            async with limiter:
                with trio.move_on_after(30):
                    stream = await trio.open_ssl_over_tcp_stream(
                        node.host, node.port, ssl_context=ctx, https_compatible=True
                    )
                    try:
                        host = f"{node.host}:{node.port}".encode()
                        buf = bytearray()
                        await stream.send_all(
                            b"POST /api/v1/query HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
                            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                        )
                        if json.loads(await _read_response(stream, buf)).get("ok"):
                            answered[0] += 1
                        for _ in range(samples):
                            t1 = time.time_ns()
                            await stream.send_all(b"GET /api/v1/time HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
                            doc = json.loads(await _read_response(stream, buf))
                            _ = (doc["receive_ns"] - t1, time.time_ns())
                        timed[0] += 1 if samples else 0
                    finally:
                        await stream.aclose()

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        return time.perf_counter() - t0, answered[0], timed[0]

    return trio.run(main)


# --- the run ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 and 32 agents, 2 repeats, 200 for the big run")
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
    sizes = [4, 32] if args.quick else [4, 32, 128]
    repeat = 2 if args.quick else args.repeat
    big = min(args.thousand, 200) if args.quick else args.thousand
    tmp = Path(tempfile.mkdtemp(prefix="ingero-bench-fleet-"))
    try:
        pki = tmp / "pki"
        make_pki(pki)
        db = tmp / "agent.db"
        shutil.copy(SAMPLE_DB, db)
        db.chmod(0o644)
        print(f"fleet fan-out: {SQL!r}, width {WIDTH}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(
            f"{'agents':>7} {'fleet ms':>9} {'raw ms':>8} {'ratio':>6} {'target':>7} {'raw-query ms':>13} "
            f"{'cpu/node fleet':>15} {'raw':>6} {'target':>7}  answered"
        )
        pool = start_agents(max(sizes), min(args.procs, max(sizes)), db, pki)
        try:
            for n in sizes:
                nodes = pool.nodes[:n]
                run_fleet(nodes, pki)  # warm-up (imports, first handshakes on each listener)
                run_raw(nodes, pki, RAW_TIME_SAMPLES)
                fleet_t, raw_t, rawq_t, fleet_cpu, raw_cpu = [], [], [], [], []
                answered = ""
                for _ in range(repeat):
                    wall, ok, skewed, cpu = run_fleet(nodes, pki)
                    fleet_t.append(wall)
                    fleet_cpu.append(cpu / n * 1000)
                    answered = f"fleet {ok}/{n} (skew {skewed})"
                    c0 = cpu_s()
                    wall, ok_raw, _ = run_raw(nodes, pki, RAW_TIME_SAMPLES)
                    raw_cpu.append((cpu_s() - c0) / n * 1000)
                    raw_t.append(wall)
                    rawq_t.append(run_raw(nodes, pki, 0)[0])
                    answered += f", raw {ok_raw}/{n}"
                f, r, q = (statistics.median(x) * 1000 for x in (fleet_t, raw_t, rawq_t))
                fc, rc = statistics.median(fleet_cpu), statistics.median(raw_cpu)
                verdict = "ok" if f / r <= TARGET_RATIO else "MISS"
                cpu_verdict = "ok" if fc <= TARGET_CPU_MS_PER_NODE else "MISS"
                print(
                    f"{n:>7} {f:>9.1f} {r:>8.1f} {f / r:>5.2f}x {'<=' + str(TARGET_RATIO) + 'x':>7} {q:>13.1f} "
                    f"{fc:>12.2f} ms {rc:>6.2f} {'<=3 ms':>7}  {answered} [wall {verdict}, cpu {cpu_verdict}]"
                )
        finally:
            pool.close()
        if big:
            t0 = time.perf_counter()
            pool = start_agents(big, max(args.procs, big // 250), db, pki)
            startup = time.perf_counter() - t0
            try:
                wall, ok, skewed, cpu = run_fleet(pool.nodes, pki)
                rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                raw_wall = run_raw(pool.nodes, pki, RAW_TIME_SAMPLES)[0]
                rawq_wall = run_raw(pool.nodes, pki, 0)[0]
                ratio = wall / raw_wall
                print(
                    f"{big} agents ({len(pool.procs)} processes, started in {startup:.1f} s): fleet_query "
                    f"{wall:.2f} s, raw {raw_wall:.2f} s: {ratio:.2f}x (target <= {TARGET_RATIO}x) "
                    f"[{'ok' if ratio <= TARGET_RATIO else 'MISS'}]; answered {ok}/{big}, skew for {skewed}"
                )
                print(
                    f"{'':>7} client CPU {cpu:.2f} s (target <= {TARGET_1000_CPU_S:g} s) "
                    f"[{'ok' if cpu <= TARGET_1000_CPU_S else 'MISS'}]; client peak RSS {rss_mb:.0f} MB "
                    f"(target < {TARGET_RSS_MB} MB) [{'ok' if rss_mb < TARGET_RSS_MB else 'MISS'}]; "
                    f"raw-query {rawq_wall:.2f} s — the agents share this machine's {os.cpu_count()} CPUs "
                    "with the client, so their TLS handshakes and queries set the floor"
                )
            finally:
                pool.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
