"""Reliability replays for the agent API (issue 17.2, 17.7): fair admission under mixed load against a
real TLS agent on loopback over a database big enough that heavy queries are slow, while a writer keeps
recording into it; saturation answers 503 with Retry-After; a chunked body over the cap is refused as
soon as the cap is passed; the database's path stays hidden.

These run several seconds of real load (marked ``reliability`` and ``slow``; CI runs them)."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ingero.agent.api.app import MAX_BODY_BYTES
from ingero.agent.api.workers import AdmissionLimits
from ingero.identity import Identity
from ingero.store.budget import QueryBudget
from ingero.store.writer import EventRow, StoreWriter
from ingero.tls.context import client_ssl_context
from tests.agent_servers import assert_error_shape, running, settings

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

T0 = 1_775_218_723_000_000_000
EVENTS = 300_000
# quadratic in the table: slow because the database is big (never finishes within its limit)
HEAVY = "SELECT count(*) FROM events a, events b WHERE a.duration < b.duration"
# a GROUP BY over the last thousand events (the timestamp index): answers in milliseconds alone
CHEAP = (
    "SELECT source, op, count(*) AS n FROM events "
    f"WHERE timestamp BETWEEN {T0 + (EVENTS - 1000) * 1000} AND {T0 + (EVENTS - 1) * 1000} GROUP BY 1, 2"
)


def _rows(start: int, n: int) -> list[EventRow]:
    return [
        (T0 + i * 1000, 100 + i % 7, 100 + i % 13, 1, 1 + i % 4, 1000 + i % 997, 0, 0, 0, 0, 0, 0)
        for i in range(start, start + n)
    ]


@pytest.fixture(scope="module")
def big_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reliability-api") / "big.db"
    with StoreWriter(path, Identity("big-node")) as w:
        sid = w.start_session({"flags": "reliability"})
        for start in range(0, EVENTS, 50_000):
            w.write_batch(_rows(start, 50_000))
        w.end_session(sid, {"events_seen": EVENTS})
    return path


class LiveWriter:
    """A writer that keeps recording into the database while the agent answers (no event may be lost)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with StoreWriter(self.path, Identity("big-node")) as w:
                sid = w.start_session({"flags": "live"})
                start = EVENTS * 10  # later than anything the queries look at
                while not self.stop.is_set():
                    self.written += w.write_batch(_rows(start + self.written, 500))
                w.end_session(sid, {"events_seen": self.written})
        except BaseException as e:  # reported by the test
            self.error = e

    def __enter__(self) -> LiveWriter:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.fixture
def recording(big_db: Path) -> Iterator[LiveWriter]:
    with LiveWriter(big_db) as rec:
        yield rec
    assert rec.error is None, rec.error
    import sqlite3

    conn = sqlite3.connect(big_db)
    try:
        total = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        conn.close()
    assert rec.written > 0 and total >= EVENTS + rec.written  # nothing lost (earlier runs may have added more)


async def _ask(client: httpx.AsyncClient, sql: str, timeout_ms: int) -> tuple[int, dict[str, Any], str | None]:
    r = await client.post("/api/v1/query", json={"sql": sql, "timeout_ms": timeout_ms})
    doc = r.json()
    if r.status_code != 200:
        assert_error_shape(r, r.status_code)
    return r.status_code, doc, r.headers.get("retry-after")


def test_cheap_queries_all_answer_while_heavy_ones_run(big_db: Path, recording: LiveWriter, tmp_path: Path) -> None:
    """20 heavy + 10 cheap at once from one client: every cheap query answers 200 (the short lane);
    heavy ones end at their own limit (408) or, when the agent is saturated, 503 — and a cheap one is
    never answered 408."""
    s = settings(big_db, tmp_path / "tls", budget=QueryBudget(max_timeout_ms=400))

    async def main() -> None:
        async with running(s) as srv:
            heavy: list[tuple[int, dict[str, Any], str | None]] = []
            cheap: list[tuple[int, dict[str, Any], str | None]] = []

            async def one(sql: str, out: list[tuple[int, dict[str, Any], str | None]]) -> None:
                out.append(await _ask(srv.client, sql, 400))

            async with trio.open_nursery() as n:
                for i in range(30):  # heavy and cheap interleaved, heavy first
                    n.start_soon(one, *((HEAVY, heavy) if i % 3 != 2 else (CHEAP, cheap)))
            assert [c[0] for c in cheap] == [200] * 10, cheap
            assert all(c[1]["rows"] and sum(r[2] for r in c[1]["rows"]) == 1000 for c in cheap)
            assert {h[0] for h in heavy} <= {408, 503} and len(heavy) == 20
            for status, doc, retry in heavy:
                if status == 408:
                    assert "400 ms time limit" in doc["error"]
                else:
                    assert retry is not None and int(retry) >= 1
            assert srv.app.ctx.workers.demoted >= 10  # the heavy ones left the short lane

    trio.run(main)


def test_saturation_is_503_with_retry_after_never_408_for_cheap(
    big_db: Path, recording: LiveWriter, tmp_path: Path
) -> None:
    limits = AdmissionLimits(short_slots=2, heavy_slots=1, max_waiting=4, max_wait_s=5)
    s = settings(big_db, tmp_path / "tls", budget=QueryBudget(max_timeout_ms=400), admission=limits)

    async def main() -> None:
        async with running(s) as srv:
            answers: list[tuple[str, int, str | None]] = []

            async def one(kind: str, sql: str) -> None:
                status, _, retry = await _ask(srv.client, sql, 400)
                answers.append((kind, status, retry))

            async with trio.open_nursery() as n:
                for _ in range(16):
                    n.start_soon(one, "heavy", HEAVY)
                for _ in range(6):
                    n.start_soon(one, "cheap", CHEAP)
            busy = [a for a in answers if a[1] == 503]
            assert busy and all(r is not None and int(r) >= 1 for _, _, r in busy)
            assert {st for kind, st, _ in answers if kind == "cheap"} <= {200, 503}
            assert {st for kind, st, _ in answers if kind == "heavy"} <= {408, 503}
            # once the flood is over, the agent answers again
            assert (await _ask(srv.client, CHEAP, 400))[0] == 200

    trio.run(main)


def test_a_flooding_client_does_not_delay_another_client(big_db: Path, tmp_path: Path) -> None:
    """Client A floods one short slot with heavy queries; client B (another address) gets its turn
    round-robin: all of B's cheap queries answer while most of A's flood still waits."""
    limits = AdmissionLimits(short_slots=1, heavy_slots=1, max_waiting=64, max_wait_s=30)
    s = settings(big_db, tmp_path / "tls", budget=QueryBudget(max_timeout_ms=300), admission=limits)

    async def main() -> None:
        async with running(s) as srv:
            verify = client_ssl_context(ca_cert=tmp_path / "tls" / "server-cert.pem")
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2", verify=verify)
            async with httpx.AsyncClient(transport=transport, base_url=srv.bound.url, timeout=60) as b:
                admission = srv.app.ctx.workers
                a_done: list[int] = []
                b_answers: list[int] = []
                a_done_when_b_finished: list[int] = []

                async def a_one() -> None:
                    a_done.append((await _ask(srv.client, HEAVY, 300))[0])

                async def b_all() -> None:
                    for _ in range(4):
                        b_answers.append((await _ask(b, CHEAP, 300))[0])
                    a_done_when_b_finished.append(len(a_done))

                async with trio.open_nursery() as n:
                    for _ in range(12):
                        n.start_soon(a_one)
                    with trio.fail_after(30):
                        while admission.waiting < 8:  # A's flood is queued
                            await trio.sleep(0.005)
                    n.start_soon(b_all)
                assert b_answers == [200] * 4
                assert a_done_when_b_finished[0] < 12 - 4  # B did not wait behind A's whole backlog
                assert set(a_done) <= {408, 503} and len(a_done) == 12

    trio.run(main)


def test_chunked_body_over_the_cap_is_refused_as_soon_as_the_cap_is_passed(big_db: Path, tmp_path: Path) -> None:
    """A client streaming an endless chunked body gets its 413 right after the cap, not at its end."""
    s = settings(big_db, tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            ctx = client_ssl_context(ca_cert=tmp_path / "tls" / "server-cert.pem")
            ctx.set_alpn_protocols(["http/1.1"])
            stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", srv.bound.port, ssl_context=ctx)
            head = b"POST /api/v1/query HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            await stream.send_all(head)
            chunk = b"x" * 65536
            sent = 0
            raw = b""

            async def read_answer() -> None:
                nonlocal raw
                while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    raw += data

            async with trio.open_nursery() as n:

                async def reader_then_stop() -> None:
                    await read_answer()
                    n.cancel_scope.cancel()

                n.start_soon(reader_then_stop)
                with trio.fail_after(60):
                    while sent < 64 * MAX_BODY_BYTES:  # "endless": far more than any cap
                        await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        sent += len(chunk)
            with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError)):
                for _ in range(1000):  # the agent closes the connection once it has dropped enough
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            status, _, rest = raw.partition(b"\r\n")
            assert status.startswith(b"HTTP/1.1 413"), raw[:200]
            doc = json.loads(rest.partition(b"\r\n\r\n")[2])
            assert doc == {"ok": False, "status": 413, "error": doc["error"]} and "limit" in doc["error"]
            assert sent < 24 * MAX_BODY_BYTES  # answered long before the body's end
            assert (await srv.get("/api/v1/health")).status_code == 200

    trio.run(main)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM pragma_database_list",
        "SELECT file FROM pragma_database_list()",
        "PRAGMA database_list",
        "SELECT * FROM pragma_database_list AS d JOIN events LIMIT 1",
    ],
)
def test_the_database_path_is_never_shown(big_db: Path, tmp_path: Path, sql: str) -> None:
    s = settings(big_db, tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            r = await srv.post("/api/v1/query", json={"sql": sql})
            doc = assert_error_shape(r, 403)
            assert str(big_db.parent) not in r.text and "not allowed" in doc["error"]

    trio.run(main)
