"""`ingero cert`: from nothing to a working mutual-TLS fleet in a few commands."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest
import trio

from ingero.agent.api.server import BoundServer, ServerSettings, serve_api
from ingero.cli.main import main
from ingero.identity import Identity
from ingero.tls import pki
from ingero.tls.context import client_ssl_context
from tests.conftest import SEED_QUERY


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_flow_ca_three_nodes_one_client_then_mtls(
    capsys: pytest.CaptureFixture[str], samples: Path, tmp_path: Path
) -> None:
    d = tmp_path / "pki"
    code, out, _ = cli(capsys, "cert", "ca", "--out", str(d))
    assert code == 0 and str(d / "ca.pem") in out and str(d / "ca-key.pem") in out
    for n in ("a", "b", "c"):
        code, out, _ = cli(capsys, "cert", "node", n, "--san", "127.0.0.1,localhost", "--ca-dir", str(d))
        assert code == 0 and str(d / f"node-{n}.pem") in out and "IP:127.0.0.1" in out
    code, out, _ = cli(capsys, "cert", "client", "me", "--ca-dir", str(d), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["cert"] == str(d / "client-me.pem") and doc["key"] == str(d / "client-me-key.pem")
    for key in ("ca-key.pem", "node-a-key.pem", "node-b-key.pem", "node-c-key.pem", "client-me-key.pem"):
        assert stat.S_IMODE((d / key).stat().st_mode) == 0o600, key

    dbs = ["sample-gpu-node-01.db", "sample-gpu-node-02.db", "sample-gpu-node-03.db"]

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            bound: list[BoundServer] = []
            for n, db in zip("abc", dbs, strict=True):
                s = ServerSettings(
                    db_path=samples / db,
                    identity=Identity(n),
                    port=0,
                    tls_cert=d / f"node-{n}.pem",
                    tls_key=d / f"node-{n}-key.pem",
                    client_ca=d / "ca.pem",
                )
                bound.append(await nursery.start(serve_api, s))
            ctx = client_ssl_context(
                ca_cert=d / "ca.pem", client_cert=d / "client-me.pem", client_key=d / "client-me-key.pem"
            )
            async with httpx.AsyncClient(verify=ctx) as c:
                for b, n, db in zip(bound, "abc", dbs, strict=True):
                    assert b.tls_mode == "mtls"
                    r = await c.post(f"{b.url}/api/v1/query", json={"sql": SEED_QUERY})
                    doc = r.json()
                    assert r.status_code == 200 and doc["node"] == n
                    assert {row[0] for row in doc["rows"]} == {db.removeprefix("sample-").removesuffix(".db")}
                    # and the same URL by name, which the SANs cover
                    r = await c.get(f"https://localhost:{b.port}/api/v1/health")
                    assert r.status_code == 200
            async with httpx.AsyncClient(verify=client_ssl_context(ca_cert=d / "ca.pem")) as no_cert:
                with pytest.raises(httpx.TransportError):
                    await no_cert.get(f"{bound[0].url}/api/v1/health")
            nursery.cancel_scope.cancel()

    trio.run(run)


def test_refuses_to_overwrite_without_force(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = tmp_path / "pki"
    assert cli(capsys, "cert", "ca", "--out", str(d))[0] == 0
    first = pki.fingerprint_sha256(pki.load_cert(d / "ca.pem"))
    code, _, err = cli(capsys, "cert", "ca", "--out", str(d))
    assert code == 2 and "already exists" in err and "--force" in err and err.count("\n") == 1
    assert pki.fingerprint_sha256(pki.load_cert(d / "ca.pem")) == first
    assert cli(capsys, "cert", "ca", "--out", str(d), "--force")[0] == 0
    assert pki.fingerprint_sha256(pki.load_cert(d / "ca.pem")) != first
    assert cli(capsys, "cert", "node", "n1", "--ca-dir", str(d))[0] == 0
    code, _, err = cli(capsys, "cert", "node", "n1", "--ca-dir", str(d))
    assert code == 2 and "node-n1.pem already exists" in err


def test_node_sans_show_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = tmp_path / "pki"
    out_dir = tmp_path / "elsewhere"
    assert cli(capsys, "cert", "ca", "--out", str(d), "--name", "test fleet")[0] == 0
    code, out, _ = cli(
        capsys, "cert", "node", "gpu-node-01", "--ca-dir", str(d), "--out", str(out_dir),
        "--san", "DNS:gpu-node-01.cluster", "--san", "IP:10.0.0.11,::1", "--san", "gpu-node-01.cluster", "--json",
    )  # fmt: skip
    doc = json.loads(out)
    assert code == 0 and Path(doc["cert"]).parent == out_dir
    assert doc["sans"] == ["DNS:gpu-node-01.cluster", "IP:10.0.0.11", "IP:::1"]
    code, out, _ = cli(capsys, "cert", "node", "solo", "--ca-dir", str(d))
    assert code == 0 and "DNS:solo" in out  # default SAN: the node name

    code, out, _ = cli(capsys, "cert", "show", doc["cert"], "--json")
    shown = json.loads(out)
    assert shown["issuer"] == "CN=test fleet,O=ingero" and shown["ca"] is False
    assert shown["fingerprint_sha256"] == doc["fingerprint_sha256"] and shown["sans"] == doc["sans"]
    code, out, _ = cli(capsys, "cert", "show", str(d / "ca.pem"))
    assert code == 0 and ["ca", "True"] in [line.split() for line in out.splitlines()]

    code, _, err = cli(capsys, "cert", "node", "x", "--ca-dir", str(tmp_path / "nothing"))
    assert code == 2 and "no CA in" in err and "ingero cert ca" in err
    code, _, err = cli(capsys, "cert", "node", "x", "--ca-dir", str(d), "--san", "IP:not-an-ip")
    assert code == 2 and "not an IP address" in err
    code, _, err = cli(capsys, "cert", "node", "x", "--ca-dir", str(d), "--san", "has space")
    assert code == 2 and "not a DNS name" in err
    code, _, err = cli(capsys, "cert", "show", str(tmp_path / "missing.pem"))
    assert code == 2 and "cannot read certificate" in err
    (tmp_path / "junk.pem").write_text("hello")
    code, _, err = cli(capsys, "cert", "show", str(tmp_path / "junk.pem"))
    assert code == 2 and "not a PEM or DER certificate" in err
