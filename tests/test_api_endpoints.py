"""The agent API's endpoints over the Ingero sample databases, through real TLS agents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from ingero.agent.api.server import BoundServer, serve_api
from ingero.asgi import ASGIApp, Receive, Scope, Send
from ingero.identity import Identity
from ingero.store.budget import QueryBudget
from ingero.tls.context import client_ssl_context
from tests.agent_servers import RUNAWAY, running, settings
from tests.conftest import SEED_QUERY, write_db


def test_health_info_time(samples: Path, tmp_path: Path) -> None:
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            h = (await srv.get("/api/v1/health")).json()
            assert h["ok"] is True and h["node"] == "test-node" and h["status"] == "ok" and h["version"]
            info = (await srv.get("/api/v1/info")).json()
            assert info["ok"] is True and info["node"] == "test-node"
            assert (info["rank"], info["local_rank"], info["world_size"]) == (0, 0, 2)
            assert info["api_version"] == 1 and info["layout"] == "ingero-0.9"
            assert (info["events"], info["chains"], info["stacks"]) == (200, 4, 8)
            assert info["first_ns"] == 1775218723111028602 and info["last_ns"] == 1775218723272966405
            assert info["live"] is False and info["tls"] == "tls" and info["auth"] == "none"
            assert isinstance(info["schema_version"], int)
            t = (await srv.get("/api/v1/time")).json()
            assert set(t) == {"ok", "node", "instance", "receive_ns", "transmit_ns"}
            assert h["instance"] == info["instance"] == t["instance"] and len(t["instance"]) == 16
            assert isinstance(t["receive_ns"], int) and t["receive_ns"] <= t["transmit_ns"]

    trio.run(main)


def test_replayed_recording_reports_its_recorded_ranks(tmp_path: Path) -> None:
    """An agent started without RANK/WORLD_SIZE over a recording reports the ranks its sessions carry."""
    from tests.conftest import INVESTIGATIONS

    s = settings(INVESTIGATIONS / "sample-gpu-node-02.db", tmp_path / "tls", identity=Identity("gpu-node-02"))

    async def main() -> None:
        async with running(s) as srv:
            info = (await srv.get("/api/v1/info")).json()
            assert (info["node"], info["rank"], info["local_rank"], info["world_size"]) == ("gpu-node-02", 1, 0, 3)
            overview = (await srv.get("/api/v1/overview")).json()
            assert (overview["rank"], overview["world_size"]) == (1, 3)

    trio.run(main)


def test_query_seed_limits_and_filters(samples: Path, tmp_path: Path) -> None:
    s = settings(samples / "sample-cluster.db", tmp_path / "tls", budget=QueryBudget(max_rows=50, max_timeout_ms=400))

    async def q(srv: Any, **body: Any) -> dict[str, Any]:
        r = await srv.post("/api/v1/query", json=body)
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc

    async def main() -> None:
        async with running(s) as srv:
            doc = await q(srv, sql=SEED_QUERY)
            assert doc["ok"] is True and doc["node"] == "test-node"
            assert doc["columns"] == ["node", "source", "cnt", "avg_us"] and len(doc["rows"]) == 8
            assert doc["rows"][3][:3] == ["gpu-node-02", 4, 40]
            assert doc["truncated"] is False and doc["truncated_reason"] is None and doc["elapsed_ms"] >= 0
            doc = await q(srv, sql="SELECT id FROM events ORDER BY id", limit=10)
            assert len(doc["rows"]) == 10 and doc["truncated"] is True and doc["truncated_reason"] == "rows"
            doc = await q(srv, sql="SELECT id FROM events", limit=5000)  # asks for more than the server allows
            assert len(doc["rows"]) == 50 and doc["truncated"] is True
            doc = await q(srv, sql="SELECT id FROM events")
            assert len(doc["rows"]) == 50
            r = await srv.post("/api/v1/query", json={"sql": RUNAWAY, "timeout_ms": 60_000})
            assert r.status_code == 408 and "400 ms" in r.json()["error"]  # capped at the server's maximum
            doc = await q(srv, sql="SELECT count(*) FROM events", op="cuMemAlloc")
            assert doc["rows"] == [[76]]
            doc = await q(srv, sql="SELECT count(*), min(timestamp) FROM events", since="1s")
            assert doc["window"]["note"] and doc["rows"][0][1] >= doc["window"]["start_ns"]
            pid = (await q(srv, sql="SELECT pid FROM events LIMIT 1"))["rows"][0][0]
            doc = await q(srv, sql="SELECT count(DISTINCT pid) FROM events", pid=pid)
            assert doc["rows"] == [[1]]
            doc = await q(srv, sql="SELECT x'00ff', 1e999, -1e999, 0.5, NULL")
            assert doc["rows"] == [["00ff", "Inf", "-Inf", 0.5, None]]

    trio.run(main)


def test_ops_chains_overview(samples: Path, tmp_path: Path) -> None:
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            ops = (await srv.get("/api/v1/ops", params={"since": "5m"})).json()
            assert ops["ok"] is True and ops["window"]["note"].startswith("not a live recording")
            by_op = {o["op"]: o for o in ops["ops"]}
            assert by_op["sched_switch"]["count"] == 99 and by_op["block_read"]["count"] == 98
            assert by_op["sched_switch"]["p50_us"] <= by_op["sched_switch"]["p95_us"] <= by_op["sched_switch"]["p99_us"]
            assert ops["host"]["sched_switch"] == 99 and ops["host"]["block_reads"] == 98

            ch = (await srv.get("/api/v1/chains")).json()
            assert ch["ok"] is True and ch["window"] == {"start_ns": None, "end_ns": None, "note": None}
            assert isinstance(ch["chains"], list)
            assert sorted(c["severity"] for c in ch["stored"]) == ["HIGH", "HIGH", "MEDIUM", "MEDIUM"]
            assert all(c["node"] == "gpu-node-01" for c in ch["stored"])
            empty = (
                await srv.get("/api/v1/chains", params={"from": "2020-01-01T00:00:00Z", "to": "2020-01-02T00:00:00Z"})
            ).json()
            assert empty["chains"] == [] and empty["stored"] == []

            ov = (await srv.get("/api/v1/overview")).json()
            assert ov["ok"] is True and ov["events"] == 200 and ov["tls"] == "tls" and ov["api_version"] == 1
            assert set(ov["chain_counts"]) == {"HIGH", "MEDIUM", "LOW"}
            assert sum(ov["chain_counts"].values()) == len(ch["chains"])
            assert 0 < len(ov["top_ops"]) <= 10 and {o["op"] for o in ov["top_ops"]} >= {"sched_switch", "block_read"}
            assert ov["host"]["sched_switch"] == 99

    trio.run(main)


def test_slow_query_never_delays_time_or_health(samples: Path, tmp_path: Path) -> None:
    """While a runaway query holds a worker, /time and /health answer; then the query times out."""
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls", budget=QueryBudget(max_timeout_ms=1500))
    entered = trio.Event()

    def spy(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] == "/api/v1/query":
                entered.set()
            await app(scope, receive, send)

        return wrapped

    async def main() -> None:
        async with running(s, wrapper=spy) as srv:
            order: list[str] = []
            busy_seen: list[int] = []
            slow: dict[str, Any] = {}

            async def run_slow() -> None:
                r = await srv.post("/api/v1/query", json={"sql": RUNAWAY, "timeout_ms": 1500})
                slow.update(status=r.status_code, doc=r.json())
                order.append("query")

            async with trio.open_nursery() as n:
                n.start_soon(run_slow)
                await entered.wait()
                while srv.app.ctx.workers.busy == 0:  # the query's thread is starting
                    await trio.sleep(0.001)
                for i in range(5):
                    t = await srv.get("/api/v1/time")
                    h = await srv.get("/api/v1/health")
                    assert t.status_code == 200 and h.status_code == 200
                    busy_seen.append(srv.app.ctx.workers.busy)
                    order.append(f"time{i}")
            assert order == ["time0", "time1", "time2", "time3", "time4", "query"]
            assert busy_seen == [1, 1, 1, 1, 1]  # every answer came while the query was running
            assert slow["status"] == 408 and "1500 ms" in slow["doc"]["error"]
            assert srv.app.ctx.workers.busy == 0

    trio.run(main)


def test_many_agents_in_one_nursery_and_clean_shutdown(tmp_path: Path) -> None:
    events = [(1_775_218_723_000_000_000 + i * 1000, 5, 5, 1, 3, 100 + i, 0, 0, 0, 0, 0, 0) for i in range(50)]
    dbs = [write_db(tmp_path / f"n{i}.db", events, node=f"gpu-{i:02d}") for i in range(8)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound: list[BoundServer] = []
            for i, db in enumerate(dbs):
                s = settings(db, tmp_path / "tls", identity=Identity(f"agent-{i}"))
                bound.append(await nursery.start(serve_api, s))
            assert len({b.port for b in bound}) == 8 and all(b.port > 0 for b in bound)
            ctx = client_ssl_context(ca_cert=tmp_path / "tls" / "server-cert.pem")
            async with httpx.AsyncClient(verify=ctx) as c:
                answers: dict[int, Any] = {}

                async def ask(i: int, b: BoundServer) -> None:
                    r = await c.post(
                        f"{b.url}/api/v1/query", json={"sql": "SELECT node, count(*) FROM events GROUP BY node"}
                    )
                    answers[i] = r.json()

                async with trio.open_nursery() as asks:
                    for i, b in enumerate(bound):
                        asks.start_soon(ask, i, b)
            for i in range(8):
                assert answers[i]["node"] == f"agent-{i}" and answers[i]["rows"] == [[f"gpu-{i:02d}", 50]]
            nursery.cancel_scope.cancel()
        # every listener is closed: connecting now fails
        for b in bound:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", b.port)
            except OSError:
                continue
            await stream.aclose()
            raise AssertionError(f"port {b.port} still accepts connections")

    trio.run(main)


def test_client_hanging_up_cancels_its_query(samples: Path, tmp_path: Path) -> None:
    """A runaway query allowed 60 s stops as soon as its client goes away, freeing the worker."""
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls", budget=QueryBudget(max_timeout_ms=60_000))

    async def main() -> None:
        async with running(s) as srv:
            workers = srv.app.ctx.workers
            with trio.CancelScope() as client_side:
                async with trio.open_nursery() as n:
                    n.start_soon(lambda: srv.post("/api/v1/query", json={"sql": RUNAWAY, "timeout_ms": 60_000}))
                    while workers.busy == 0:  # the query is running in its thread
                        await trio.sleep(0.001)
                    client_side.cancel()  # the client gives up: httpx drops the connection
            with trio.fail_after(30):  # far below the query's own 60 s budget
                while workers.busy:
                    await trio.sleep(0.005)
            r = await srv.post("/api/v1/query", json={"sql": "SELECT 1"})
            assert r.status_code == 200

    trio.run(main)
