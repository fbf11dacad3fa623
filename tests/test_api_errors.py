"""Every failure of the agent API answers the one JSON error shape, and the server keeps serving.

Real agents on 127.0.0.1 (port 0) over TLS 1.3 with the self-signed certificate they make.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ingero.agent.api import endpoints
from ingero.tls.context import client_ssl_context
from tests.agent_servers import RUNAWAY, assert_error_shape, running, settings

Case = tuple[str, str, str, dict[str, Any], int, str]  # name, method, path, httpx kwargs, status, words in error

CASES: list[Case] = [
    ("bad JSON", "POST", "/api/v1/query", {"content": b'{"sql": "SELECT 1"'}, 400, "not valid JSON"),
    ("JSON not an object", "POST", "/api/v1/query", {"json": ["SELECT 1"]}, 400, "JSON object"),
    ("empty body", "POST", "/api/v1/query", {"content": b""}, 400, "empty"),
    ("missing sql", "POST", "/api/v1/query", {"json": {"limit": 5}}, 400, "missing field 'sql'"),
    ("sql not a string", "POST", "/api/v1/query", {"json": {"sql": 42}}, 400, "must be a string"),
    ("limit a string", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "limit": "10"}}, 400, "'limit'"),
    ("limit a bool", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "limit": True}}, 400, "'limit'"),
    ("limit zero", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "limit": 0}}, 400, "at least 1"),
    ("timeout a float", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "timeout_ms": 1.5}}, 400, "'timeout_ms'"),
    ("timeout negative", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "timeout_ms": -1}}, 400, "at least 1"),
    ("unknown field", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "sq1": "x"}}, 400, "unknown field"),
    (
        "huge integer",
        "POST",
        "/api/v1/query",
        {"content": b'{"sql": "SELECT 1", "limit": ' + b"9" * 5000 + b"}"},
        400,
        "JSON",
    ),
    ("deep nesting", "POST", "/api/v1/query", {"content": b"[" * 100_000 + b"]" * 100_000}, 400, "JSON"),
    ("non-UTF-8 body", "POST", "/api/v1/query", {"content": b'{"sql": "SELECT \xff\xfe"}'}, 400, "not UTF-8"),
    ("10 MB body", "POST", "/api/v1/query", {"content": b"x" * (10 * 1024 * 1024)}, 413, "limit"),
    ("bad window filter", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "since": "soon"}}, 400, "duration"),
    ("unknown op filter", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1", "op": "cudaFly"}}, 400, "cudaFly"),
    ("SQL syntax error", "POST", "/api/v1/query", {"json": {"sql": "SELEC 1"}}, 400, "syntax error"),
    ("unknown table", "POST", "/api/v1/query", {"json": {"sql": "SELECT * FROM nope"}}, 400, "no such table"),
    ("write refused", "POST", "/api/v1/query", {"json": {"sql": "DELETE FROM events"}}, 403, "read-only"),
    ("two statements", "POST", "/api/v1/query", {"json": {"sql": "SELECT 1; SELECT 2"}}, 403, "one SQL statement"),
    ("value too big", "POST", "/api/v1/query", {"json": {"sql": "SELECT zeroblob(100000000)"}}, 413, "cap"),
    ("query timeout", "POST", "/api/v1/query", {"json": {"sql": RUNAWAY, "timeout_ms": 100}}, 408, "100 ms"),
    ("unknown route", "GET", "/api/v1/nope", {}, 404, "no such endpoint"),
    ("outside the API", "GET", "/", {}, 404, "no such endpoint"),
    ("old API version", "GET", "/api/v0/health", {}, 404, "no such endpoint"),
    ("GET on query", "GET", "/api/v1/query", {}, 405, "POST"),
    ("POST on health", "POST", "/api/v1/health", {"json": {}}, 405, "GET"),
    ("DELETE on info", "DELETE", "/api/v1/info", {}, 405, "not allowed"),
    ("bad since", "GET", "/api/v1/ops", {"params": {"since": "banana"}}, 400, "banana"),
    ("negative since", "GET", "/api/v1/chains", {"params": {"since": "-5m"}}, 400, "duration"),
    ("since and from", "GET", "/api/v1/overview", {"params": {"since": "5m", "from": "1775218723"}}, 400, "both"),
    ("bad from", "GET", "/api/v1/ops", {"params": {"from": "yesterday-ish"}}, 400, "yesterday-ish"),
    ("to before from", "GET", "/api/v1/ops", {"params": {"from": "1775218723", "to": "1775218000"}}, 400, "before"),
    ("unknown parameter", "GET", "/api/v1/ops", {"params": {"sinse": "5m"}}, 400, "unknown parameter"),
    ("parameter on time", "GET", "/api/v1/time", {"params": {"x": "1"}}, 400, "no parameters"),
    ("non-UTF-8 query string", "GET", "/api/v1/ops?since=%ff%fe", {}, 400, "UTF-8"),
]


def test_every_error_path_has_the_one_shape_and_the_server_keeps_serving(samples: Path, tmp_path: Path) -> None:
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            for name, method, path, kw, status, words in CASES:
                r = await srv.client.request(method, path, **kw)
                doc = assert_error_shape(r, status)
                assert words.lower() in doc["error"].lower(), (name, doc)
                if status == 405:
                    assert r.headers["allow"] in ("GET", "POST")
                health = await srv.get("/api/v1/health")
                assert health.status_code == 200 and health.json()["status"] == "ok", name

    trio.run(main)


def test_internal_errors_are_a_generic_500_and_logged(
    samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: Any) -> bytes:
        raise RuntimeError("secret internals /etc/shadow")

    monkeypatch.setattr(endpoints, "ops", broken)
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            doc = assert_error_shape(await srv.get("/api/v1/ops"), 500)
            assert "secret" not in doc["error"] and "log" in doc["error"]
            assert (await srv.get("/api/v1/health")).status_code == 200

    trio.run(main)
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


def test_database_gone_after_start_is_a_clear_error(sample_copy: Path, tmp_path: Path) -> None:
    db = sample_copy / "sample-gpu-node-02.db"
    s = settings(db, tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            assert (await srv.get("/api/v1/info")).status_code == 200
            db.unlink()
            doc = assert_error_shape(await srv.post("/api/v1/query", json={"sql": "SELECT 1"}), 404)
            assert "no such database" in doc["error"] and db.name in doc["error"]
            assert str(db.parent) not in doc["error"]  # where the database lives stays on the node
            db.write_bytes(b"this is not sqlite" * 100)
            assert str(db.parent) not in assert_error_shape(await srv.get("/api/v1/info"), 422)["error"]
            assert (await srv.get("/api/v1/time")).status_code == 200

    trio.run(main)


def test_token_is_required_on_every_endpoint(samples: Path, tmp_path: Path) -> None:
    token = "s3cret-token-for-tests"
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls", token=token)

    async def main() -> None:
        async with running(s) as srv:
            for method, path in (
                ("GET", "/api/v1/health"),
                ("GET", "/api/v1/time"),
                ("POST", "/api/v1/query"),
                ("GET", "/api/v1/nope"),
            ):
                r = await srv.client.request(method, path)
                doc = assert_error_shape(r, 401)
                assert "missing bearer token" in doc["error"]
                assert r.headers["www-authenticate"].startswith("Bearer")
            for header in (
                f"Bearer {token}x",
                f"Bearer {token[:-1]}",
                f"Basic {token}",
                token,
                "Bearer",
                f"Bearer  {token}x",
            ):
                r = await srv.get("/api/v1/health", headers={"Authorization": header})
                assert_error_shape(r, 401)
            auth = {"Authorization": f"Bearer {token}"}
            r = await srv.post("/api/v1/query", json={"sql": "SELECT count(*) AS n FROM events"}, headers=auth)
            assert r.status_code == 200 and r.json()["rows"] == [[200]]
            info = (await srv.get("/api/v1/info", headers=auth)).json()
            assert info["auth"] == "token"
            r = await srv.get(
                "/api/v1/health", headers={"authorization": f"bearer {token}"}
            )  # scheme is case-insensitive
            assert r.status_code == 200

    trio.run(main)


def test_declared_huge_body_is_refused_before_it_is_sent(samples: Path, tmp_path: Path) -> None:
    """A raw client announcing 200 MB gets 413 in the one shape without sending a byte of it."""
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with running(s) as srv:
            ctx = client_ssl_context(ca_cert=tmp_path / "tls" / "server-cert.pem")
            ctx.set_alpn_protocols(["http/1.1"])
            stream = await trio.open_ssl_over_tcp_stream(
                "127.0.0.1", srv.bound.port, ssl_context=ctx, https_compatible=True
            )
            head = (
                "POST /api/v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {200 * 1024 * 1024}\r\n\r\n"
            )
            await stream.send_all(head.encode())
            raw = b""
            while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                raw += chunk
            await stream.aclose()
            status_line, _, rest = raw.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 413"), raw
            doc = json.loads(rest.partition(b"\r\n\r\n")[2])
            assert doc["ok"] is False and doc["status"] == 413 and "limit" in doc["error"]
            assert (await srv.get("/api/v1/health")).status_code == 200

    trio.run(main)


def test_http2_clients_get_the_same_answers(samples: Path, tmp_path: Path) -> None:
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")

    async def main() -> None:
        async with (
            running(s) as srv,
            httpx.AsyncClient(
                http2=True,
                verify=client_ssl_context(ca_cert=tmp_path / "tls" / "server-cert.pem"),
                base_url=srv.bound.url,
            ) as h2,
        ):
            r = await h2.get("/api/v1/health")
            assert r.http_version == "HTTP/2" and r.json()["status"] == "ok"
            assert_error_shape(await h2.post("/api/v1/query", content=b"x" * (3 * 1024 * 1024)), 413)
            assert_error_shape(await h2.get("/api/v1/query"), 405)
            r = await h2.post("/api/v1/query", json={"sql": "SELECT count(*) FROM events"})
            assert r.http_version == "HTTP/2" and r.json()["rows"] == [[200]]

    trio.run(main)


def test_a_saturated_agent_answers_503_with_retry_after_in_the_one_shape(samples: Path, tmp_path: Path) -> None:
    """One heavy slot held by a runaway: a second runaway, moved out of the short lane, finds no heavy
    slot within the wait limit and is answered 503 + Retry-After (not 408); the first ends at its own limit."""
    from ingero.agent.api.workers import AdmissionLimits

    limits = AdmissionLimits(short_slots=1, heavy_slots=1, quantum_ms=10, max_waiting=1, max_wait_s=0.05)
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls", admission=limits)

    async def main() -> None:
        async with running(s) as srv:
            answers: dict[str, httpx.Response] = {}

            async def ask(name: str) -> None:
                answers[name] = await srv.post("/api/v1/query", json={"sql": RUNAWAY, "timeout_ms": 500})

            async with trio.open_nursery() as n:
                n.start_soon(ask, "first")
                with trio.fail_after(30):
                    while srv.app.ctx.workers.demoted == 0:  # the first holds the heavy slot
                        await trio.sleep(0.002)
                n.start_soon(ask, "second")
            doc = assert_error_shape(answers["second"], 503)
            assert "agent busy" in doc["error"] and answers["second"].headers["retry-after"] == "1"
            assert "500 ms time limit" in assert_error_shape(answers["first"], 408)["error"]
            assert (await srv.post("/api/v1/query", json={"sql": "SELECT 1"})).status_code == 200

    trio.run(main)
