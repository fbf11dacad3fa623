"""Fan-out against real agents on 127.0.0.1 (mTLS, ingero's own PKI): healthy, hung, failing,
cut-off, off-schema, truncating, token-protected and absent nodes, each ending as its own outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives import hashes

from ingero.config import NodeSpec
from ingero.fleet.client import FleetClient
from ingero.fleet.operations import fleet_explain, fleet_query, fleet_status
from ingero.fleet.outcome import Kind, NodeOutcome
from ingero.tls.pki import create_ca
from tests.conftest import SEED_QUERY, write_db
from tests.fleet_agents import (
    AgentSpec,
    Pki,
    client_settings,
    closed_port,
    cut_off,
    fail,
    hang,
    make_pki,
    node_specs,
    rewrite_json,
    start_agents,
    straggler_events,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def by_label(outcomes: list[NodeOutcome]) -> dict[str, NodeOutcome]:
    return {o.label: o for o in outcomes}


def test_healthy_fleet_merges_rows_with_agent_identity(pki: Pki, samples: Path) -> None:
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (1, 2, 3)]

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            servers = await start_agents(nursery, pki, specs)
            result = await fleet_query(node_specs(servers), client_settings(pki), SEED_QUERY)
            nursery.cancel_scope.cancel()
        return result

    result = trio.run(main)
    assert [o.kind for o in result.outcomes] == [Kind.OK] * 3
    assert result.columns == ["node", "source", "cnt", "avg_us"]
    assert len(result.rows) == 8
    assert {r[0] for r in result.rows} == {"gpu-node-01", "gpu-node-02", "gpu-node-03"}
    assert sum(r[2] for r in result.rows) == 600
    for o in result.outcomes:
        assert o.skew is not None and o.skew.samples == 2
        # Same host, same clock: the true offset is 0 and must lie inside the stated uncertainty.
        assert o.skew.contains(0, slack_ns=50_000), o.skew


def test_faulty_nodes_each_end_as_their_outcome(pki: Pki, samples: Path) -> None:
    db = samples / "sample-gpu-node-02.db"

    def other_columns(body: dict[str, Any]) -> dict[str, Any]:
        body["columns"] = [c.upper() for c in body["columns"]]
        return body

    def no_ok(body: dict[str, Any]) -> dict[str, Any]:
        body.pop("ok", None)
        return body

    specs = [
        AgentSpec(samples / "sample-gpu-node-01.db", "healthy-01"),
        AgentSpec(db, "healthy-02"),
        AgentSpec(db, "hung", wrapper=hang("/api/v1/query")),
        AgentSpec(db, "failing", wrapper=fail("/api/v1/query")),
        AgentSpec(db, "cutoff", wrapper=cut_off("/api/v1/query")),
        AgentSpec(db, "renamed", wrapper=rewrite_json("/api/v1/query", other_columns)),
        AgentSpec(db, "no-ok", wrapper=rewrite_json("/api/v1/query", no_ok)),
        AgentSpec(db, "locked", token="s3cret"),
    ]
    dead = NodeSpec("127.0.0.1", closed_port(), "gone")

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            servers = await start_agents(nursery, pki, specs)
            nodes = node_specs(servers)
            # a 401 answer names no node: the operator's label stands in (as a config {name, addr} would)
            nodes[-1] = NodeSpec(nodes[-1].host, nodes[-1].port, "locked")
            result = await fleet_query([*nodes, dead], client_settings(pki, timeout_s=1.0), SEED_QUERY)
            nursery.cancel_scope.cancel()
        return result

    result = trio.run(main)
    got = by_label(result.outcomes)
    assert {k: str(o.kind) for k, o in got.items()} == {
        "healthy-01": "ok",
        "healthy-02": "ok",
        "hung": "timeout",
        "failing": "http",
        "cutoff": "protocol",
        "renamed": "schema",
        "no-ok": "schema",
        "locked": "auth",
        "gone": "refused",
    }
    assert got["failing"].reason == "HTTP 500: disk I/O error reading the trace database"
    assert got["failing"].status == 500
    assert "differ from the other nodes'" in got["renamed"].reason
    assert "within 1s" in got["hung"].reason and "/time answer did arrive" in got["hung"].reason
    assert got["hung"].skew is not None  # its /time kept answering while /query hung
    assert got["locked"].status == 401
    assert "connection refused" in got["gone"].reason
    # the healthy rows are all there, under the agents' own names
    assert {r[0] for r in result.rows} == {"healthy-01", "healthy-02"}
    assert len(result.rows) == 5


def test_agent_side_truncation_keeps_rows_and_says_so(pki: Pki, samples: Path) -> None:
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (1, 2, 3)]

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            servers = await start_agents(nursery, pki, specs)
            result = await fleet_query(
                node_specs(servers), client_settings(pki), "SELECT id, op FROM events ORDER BY id", limit=5
            )
            nursery.cancel_scope.cancel()
        return result

    result = trio.run(main)
    assert [o.kind for o in result.outcomes] == [Kind.TRUNCATED] * 3
    assert all(o.answered and o.reason for o in result.outcomes)
    assert len(result.rows) == 15
    assert result.meta()["truncated"] is True


def test_tls_failures_are_classified(pki: Pki, samples: Path, tmp_path: Path) -> None:
    db = samples / "sample-gpu-node-01.db"
    create_ca(tmp_path, "a CA that signed nothing the agents use")
    specs = [AgentSpec(db, "mtls"), AgentSpec(db, "plain", no_tls=True)]

    async def main() -> dict[str, list[NodeOutcome]]:
        out: dict[str, list[NodeOutcome]] = {}
        async with trio.open_nursery() as nursery:
            mtls, plain = await start_agents(nursery, pki, specs)
            n_mtls, n_plain = NodeSpec(mtls.host, mtls.port), NodeSpec(plain.host, plain.port)
            cases = {
                "wrong_ca": ([n_mtls], client_settings(pki, ca_cert=str(tmp_path / "ca.pem"))),
                "no_client_cert": ([n_mtls], client_settings(pki, client_cert=None, client_key=None)),
                "tls_to_plain": ([n_plain], client_settings(pki)),
                "plain_ok": ([n_plain], client_settings(pki, plaintext=True)),
            }
            for name, (nodes, settings) in cases.items():
                async with FleetClient(nodes, settings) as fc:
                    out[name] = await fc.request_all("GET", "/api/v1/health")
            nursery.cancel_scope.cancel()
        return out

    out = trio.run(main)
    wrong_ca = out["wrong_ca"][0]
    assert wrong_ca.kind is Kind.TLS and "cannot verify the agent's certificate" in wrong_ca.reason
    assert out["no_client_cert"][0].kind is Kind.TLS
    assert "client certificate" in out["no_client_cert"][0].reason
    assert out["tls_to_plain"][0].kind is Kind.TLS
    assert "does not speak TLS" in out["tls_to_plain"][0].reason
    assert out["plain_ok"][0].kind is Kind.OK and out["plain_ok"][0].node == "plain"


def expired_cert(d: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 that expired yesterday (and its key)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from ingero.tls.pki import cert_pem, key_pem, new_key

    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=10))
        .not_valid_after(now - dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    (d / "expired.pem").write_bytes(cert_pem(cert))
    (d / "expired-key.pem").write_bytes(key_pem(key))
    return d / "expired.pem", d / "expired-key.pem"


def test_each_failure_has_its_own_words(pki: Pki, samples: Path, tmp_path: Path) -> None:
    """Classified by exception type and OpenSSL/errno code: an expired certificate, a refused port and a
    black hole (TCP accepted, TLS never answered) each get their own kind, words and hint."""
    import socket

    from ingero.agent.api.server import ServerSettings, serve_api
    from ingero.identity import Identity

    cert, key = expired_cert(tmp_path)
    db = samples / "sample-gpu-node-01.db"
    expired = ServerSettings(db_path=db, identity=Identity("old"), host="127.0.0.1", port=0, tls_cert=cert, tls_key=key)

    async def main() -> dict[str, NodeOutcome]:
        out: dict[str, NodeOutcome] = {}
        with socket.socket() as hole:
            hole.bind(("127.0.0.1", 0))
            hole.listen(4)
            async with trio.open_nursery() as nursery:
                server = await nursery.start(serve_api, expired)
                cases = {
                    "expired": (NodeSpec("127.0.0.1", server.port), client_settings(pki, ca_cert=str(cert))),
                    "refused": (NodeSpec("127.0.0.1", closed_port()), client_settings(pki)),
                    "black_hole": (NodeSpec("127.0.0.1", hole.getsockname()[1]), client_settings(pki, timeout_s=0.3)),
                }
                for name, (node, settings) in cases.items():
                    async with FleetClient([node], settings) as fc:
                        out[name] = (await fc.request_all("GET", "/api/v1/health"))[0]
                nursery.cancel_scope.cancel()
        return out

    out = trio.run(main)
    assert out["expired"].kind is Kind.TLS
    assert "certificate has expired" in out["expired"].reason and "ingero cert node" in out["expired"].reason
    assert out["refused"].kind is Kind.REFUSED and "is the agent running?" in out["refused"].reason
    assert out["black_hole"].kind is Kind.TIMEOUT and "within 0.3s" in out["black_hole"].reason


def test_explain_merges_chains_and_names_the_straggler(pki: Pki, tmp_path: Path) -> None:
    dbs = {
        "gpu-node-01": write_db(tmp_path / "n1.db", straggler_events(850, 18.4, 1, tail=True), node="gpu-node-01"),
        "gpu-node-02": write_db(tmp_path / "n2.db", straggler_events(200, 2.0, 2), node="gpu-node-02"),
        "gpu-node-03": write_db(tmp_path / "n3.db", straggler_events(210, 2.1, 3), node="gpu-node-03"),
    }
    specs = [AgentSpec(db, node, rank=i, world_size=3) for i, (node, db) in enumerate(dbs.items())]

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            servers = await start_agents(nursery, pki, specs)
            nodes = node_specs(servers)
            settings = client_settings(pki)
            async with FleetClient(nodes, settings) as fc:
                explained = await fleet_explain(nodes, settings, client=fc)
                status = await fleet_status(nodes, settings, client=fc)
            nursery.cancel_scope.cancel()
        return explained, status

    explained, status = trio.run(main)
    assert len(explained.answered) == 3
    v = explained.verdict
    assert v.outlier == "gpu-node-01"
    assert v.line.startswith("gpu-node-01 is the outlier: 850 host events at ")
    assert "vs peers ~2" in v.line
    ranks = [c.severity_rank for c in explained.chains]
    assert ranks and ranks == sorted(ranks)
    assert explained.chains[0].node == "gpu-node-01"  # the straggler's chain first (severity: the engine's call)
    assert all(c.node in dbs for c in explained.chains)
    rows = {r[1]: r for r in status.rows()}
    assert set(rows) == set(dbs)
    assert rows["gpu-node-01"][0] == "yes"
    assert rows["gpu-node-02"][3] == "1/3"
    assert rows["gpu-node-03"][status.columns.index("events")] == 510
    assert rows["gpu-node-01"][status.columns.index("tls")].startswith("mtls")


def test_connections_shared_per_node_and_released_on_wide_fleets(pki: Pki, samples: Path) -> None:
    """Skew samples ride the query's keep-alive connection (one TLS handshake per node); a fleet
    wider than the fan-out drops each node's connections once that node is done."""
    db = samples / "sample-gpu-node-03.db"
    specs = [AgentSpec(db, f"n{i}") for i in range(5)]

    seen: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nodes = node_specs(await start_agents(nursery, pki, specs))
            narrow = client_settings(pki, timeout_s=20.0)  # patience 10 s: the query is long done by then
            async with FleetClient(nodes[:3], narrow) as fc:
                first = await fc.request_all("GET", "/api/v1/info")
                opened = fc.transport.connections_opened
                again = await fc.request_all("GET", "/api/v1/info")  # kept-alive connections reused
                seen.update(first=first + again, opened=opened, reopened=fc.transport.connections_opened - opened)
            async with FleetClient(nodes, narrow.with_(fanout=2)) as fc:
                seen["wide"] = await fc.request_all("GET", "/api/v1/health")
                seen["nodes_left"] = fc.transport.open_nodes
            nursery.cancel_scope.cancel()

    trio.run(main)
    first, opened, reopened, outcomes, pools_left = (
        seen[k] for k in ("first", "opened", "reopened", "wide", "nodes_left")
    )
    assert all(o.kind is Kind.OK and o.skew is not None and o.skew.samples == 2 for o in first)
    assert opened == 3 and reopened == 0
    assert [o.kind for o in outcomes] == [Kind.OK] * 5
    assert pools_left == 0


def test_window_filters_reach_every_agent(pki: Pki, samples: Path) -> None:
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (2, 3)]
    sql = "SELECT count(*) AS n FROM events"

    async def main() -> tuple[Any, Any, Any]:
        async with trio.open_nursery() as nursery:
            nodes = node_specs(await start_agents(nursery, pki, specs))
            settings = client_settings(pki)
            whole = await fleet_query(nodes, settings, sql)
            recent = await fleet_query(nodes, settings, sql, since="500ms")
            writes = await fleet_query(nodes, settings, sql, op="block_write")
            nursery.cancel_scope.cancel()
        return whole, recent, writes

    whole, recent, writes = trio.run(main)
    full = {r[0]: r[1] for r in whole.rows}
    assert full == {"gpu-node-02": 200, "gpu-node-03": 200}
    # each agent counts --since back from the end of its own (finished) recording
    assert all(0 < r[1] < full[r[0]] for r in recent.rows)
    assert {r[0]: r[1] for r in writes.rows} == {"gpu-node-02": 98, "gpu-node-03": 106}
