"""TLS of the agent API with real servers and real certificates: TLS 1.3 only, mutual TLS, tokens on
top, the self-signed certificate an agent makes for itself, plaintext only when asked for."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec

from ingero.agent.api.server import BoundServer, serve_api
from ingero.errors import TLSConfigError, UsageError
from ingero.tls import context, pki
from tests.agent_servers import Pki, make_pki, running, settings
from tests.conftest import SAMPLES


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client(p: Pki, *, with_cert: bool = True, rogue: bool = False) -> ssl.SSLContext:
    if rogue:
        return context.client_ssl_context(ca_cert=p.ca, client_cert=p.rogue_cert, client_key=p.rogue_key)
    if with_cert:
        return context.client_ssl_context(ca_cert=p.ca, client_cert=p.client_cert, client_key=p.client_key)
    return context.client_ssl_context(ca_cert=p.ca)


def _causes(e: BaseException | None) -> str:
    """The exception and everything it was raised from (httpx wraps the ssl error twice)."""
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


async def _handshake_version(port: int, ctx: ssl.SSLContext) -> str | None:
    stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=ctx, https_compatible=True)
    try:
        await stream.do_handshake()
        return stream.version()  # type: ignore[no-any-return]
    finally:
        await stream.aclose()


def test_tls13_works_and_tls12_is_refused(samples: Path, tmp_path: Path, certs: Pki) -> None:
    s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls", tls_cert=certs.node_cert, tls_key=certs.node_key)

    async def main() -> None:
        async with running(s, verify=_client(certs, with_cert=False)) as srv:
            assert srv.bound.tls_mode == "tls" and srv.bound.url.startswith("https://127.0.0.1:")
            assert srv.bound.fingerprint_sha256 == pki.fingerprint_sha256(pki.load_cert(certs.node_cert))
            assert await _handshake_version(srv.bound.port, _client(certs, with_cert=False)) == "TLSv1.3"
            r = await srv.get("/api/v1/info")
            assert r.status_code == 200 and r.json()["tls"] == "tls"

            old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            old.load_verify_locations(certs.ca)
            old.minimum_version = ssl.TLSVersion.TLSv1_2
            old.maximum_version = ssl.TLSVersion.TLSv1_2
            async with httpx.AsyncClient(verify=old, base_url=srv.bound.url) as c:
                with pytest.raises(httpx.ConnectError) as refused:
                    await c.get("/api/v1/health")
            # refused in the handshake (trio drops the server's alert, so the client sees the TLS session end)
            assert "SSL" in _causes(refused.value).upper()
            assert (await srv.get("/api/v1/health")).status_code == 200  # still serving TLS 1.3 clients

    trio.run(main)


def test_mtls_refuses_clients_without_a_certificate_from_the_ca(samples: Path, tmp_path: Path, certs: Pki) -> None:
    s = settings(
        samples / "sample-gpu-node-01.db",
        tmp_path / "tls",
        tls_cert=certs.node_cert,
        tls_key=certs.node_key,
        client_ca=certs.ca,
    )

    async def main() -> None:
        async with running(s, verify=_client(certs)) as srv:
            assert srv.bound.tls_mode == "mtls"
            r = await srv.get("/api/v1/info")
            assert r.status_code == 200 and r.json()["tls"] == "mtls"
            for ctx in (_client(certs, with_cert=False), _client(certs, rogue=True)):
                async with httpx.AsyncClient(verify=ctx, base_url=srv.bound.url) as c:
                    # TLS 1.3: the client finishes its side first, then the server's verdict ends the session
                    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                        await c.get("/api/v1/health")
            # the handshake is where it fails: no HTTP answer, not even a 401
            with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
                stream = await trio.open_ssl_over_tcp_stream(
                    "127.0.0.1", srv.bound.port, ssl_context=_client(certs, with_cert=False)
                )
                await stream.send_all(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                await stream.receive_some(1024)
            assert (await srv.get("/api/v1/health")).status_code == 200

    trio.run(main)


def test_token_on_top_of_mtls(samples: Path, tmp_path: Path, certs: Pki) -> None:
    s = settings(
        samples / "sample-gpu-node-01.db",
        tmp_path / "tls",
        tls_cert=certs.node_cert,
        tls_key=certs.node_key,
        client_ca=certs.ca,
        token="t0ken",
    )

    async def main() -> None:
        async with running(s, verify=_client(certs)) as srv:
            assert (await srv.get("/api/v1/health")).status_code == 401
            r = await srv.get("/api/v1/info", headers={"Authorization": "Bearer t0ken"})
            assert r.status_code == 200 and (r.json()["tls"], r.json()["auth"]) == ("mtls", "token")

    trio.run(main)


def test_self_signed_certificate_is_made_once_and_pinnable(samples: Path, tmp_path: Path) -> None:
    tls_dir = tmp_path / "home" / ".ingero" / "tls"
    s = settings(samples / "sample-gpu-node-01.db", tls_dir)
    fingerprints: list[str | None] = []

    async def main() -> None:
        for _ in range(2):
            async with running(s) as srv:
                assert srv.bound.tls_mode == "tls"
                fingerprints.append(srv.bound.fingerprint_sha256)
                assert (await srv.get("/api/v1/health")).status_code == 200
                # a client that pins the fingerprint instead of trusting a CA
                insecure = context.client_ssl_context(insecure=True)
                stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", srv.bound.port, ssl_context=insecure)
                await stream.do_handshake()
                der = stream.getpeercert(binary_form=True)
                await stream.aclose()
                assert pki.fingerprint_sha256(der) == srv.bound.fingerprint_sha256

    trio.run(main)
    assert fingerprints[0] == fingerprints[1] and fingerprints[0] is not None  # reused, not remade
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    for name in (context.AUTO_CERT, context.AUTO_KEY):
        assert stat.S_IMODE((tls_dir / name).stat().st_mode) == 0o600
    cert = pki.load_cert(tls_dir / context.AUTO_CERT)
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    sans = pki.san_strings(cert)
    assert {"DNS:localhost", "IP:127.0.0.1", "IP:::1"} <= set(sans)
    assert any(s.startswith("DNS:") and s != "DNS:localhost" for s in sans)  # the host's own name


def test_self_signed_certificate_is_renewed_when_it_expires_soon(tmp_path: Path) -> None:
    first = context.ensure_auto_cert(tmp_path, common_name="n1")
    assert first.created
    again = context.ensure_auto_cert(tmp_path, common_name="n1")
    assert not again.created and again.fingerprint_sha256 == first.fingerprint_sha256
    cert, key = pki.self_signed_server_cert("n1", context.host_sans(), days=3)
    pki.write_file(tmp_path / context.AUTO_KEY, pki.key_pem(key))
    pki.write_file(tmp_path / context.AUTO_CERT, pki.cert_pem(cert))
    renewed = context.ensure_auto_cert(tmp_path, common_name="n1")
    assert renewed.created and renewed.fingerprint_sha256 != pki.fingerprint_sha256(cert)
    wider = context.ensure_auto_cert(tmp_path, common_name="n1", extra_names=["10.99.0.7"])
    assert wider.created and "IP:10.99.0.7" in pki.san_strings(pki.load_cert(wider.cert))


def test_certificates_pass_strict_x509_verification(samples: Path, tmp_path: Path, certs: Pki) -> None:
    """OpenSSL's strict mode (Python 3.13's default) accepts what ingero issues."""
    s_ca = settings(samples / "sample-gpu-node-01.db", tmp_path / "a", tls_cert=certs.node_cert, tls_key=certs.node_key)
    s_self = settings(samples / "sample-gpu-node-01.db", tmp_path / "b")

    async def main() -> None:
        for s, ca, verify in (
            (s_ca, certs.ca, _client(certs, with_cert=False)),
            (s_self, tmp_path / "b" / context.AUTO_CERT, None),
        ):
            async with running(s, verify=verify) as srv:
                strict = context.client_ssl_context(ca_cert=ca)
                strict.verify_flags |= ssl.VERIFY_X509_STRICT
                assert await _handshake_version(srv.bound.port, strict) == "TLSv1.3"

    trio.run(main)


def test_plaintext_only_when_asked_and_loopback_unless_the_risk_is_named(samples: Path, tmp_path: Path) -> None:
    db = samples / "sample-gpu-node-01.db"

    async def main() -> None:
        async with running(settings(db, tmp_path / "tls", no_tls=True)) as srv:
            assert srv.bound.url.startswith("http://") and srv.bound.fingerprint_sha256 is None
            assert (await srv.get("/api/v1/info")).json()["tls"] == "plaintext"
        with pytest.raises(UsageError, match="refusing plain HTTP"):
            await serve_api(settings(db, tmp_path / "tls", no_tls=True, host="0.0.0.0"))
        async with trio.open_nursery() as n:
            bound: BoundServer = await n.start(
                serve_api,
                settings(
                    db,
                    tmp_path / "tls",
                    no_tls=True,
                    host="0.0.0.0",
                    allow_plaintext_remote=True,
                    insecure_no_auth=True,
                ),
            )
            assert bound.tls_mode == "plaintext" and bound.port > 0
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"http://127.0.0.1:{bound.port}/api/v1/health")).status_code == 200
            n.cancel_scope.cancel()

    trio.run(main)


def test_bad_tls_settings_fail_before_listening(samples: Path, tmp_path: Path, certs: Pki) -> None:
    db = samples / "sample-gpu-node-01.db"
    bad = [
        (settings(db, tmp_path, tls_cert=certs.node_cert), UsageError, "go together"),
        (
            settings(db, tmp_path, tls_cert=certs.node_cert, tls_key=certs.client_key),
            TLSConfigError,
            "is not the key of",
        ),
        (
            settings(db, tmp_path, tls_cert=tmp_path / "nope.pem", tls_key=certs.node_key),
            TLSConfigError,
            "no such file",
        ),
        (settings(db, tmp_path, client_ca=tmp_path / "nope.pem"), TLSConfigError, "no such file"),
        (
            settings(db, tmp_path, tls_cert=certs.node_cert, tls_key=certs.node_key, no_tls=True),
            UsageError,
            "conflicts",
        ),
    ]

    async def main() -> None:
        for s, error, words in bad:
            with pytest.raises(error, match=words), trio.fail_after(30):
                await serve_api(s)

    trio.run(main)


def test_client_context_rejects_half_a_client_identity(certs: Pki) -> None:
    with pytest.raises(TLSConfigError, match="go together"):
        context.client_ssl_context(ca_cert=certs.ca, client_cert=certs.client_cert)
    ctx = context.client_ssl_context(ca_cert=certs.ca)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3 and ctx.verify_mode == ssl.CERT_REQUIRED


def test_admission_tells_mtls_clients_apart_by_certificate_subject(certs: Pki, tmp_path: Path) -> None:
    """Two clients on the same address with different certificates are two identities for fair
    admission; without a client certificate the identity is the peer address."""
    from ingero.agent.api.workers import client_identity
    from ingero.asgi import ASGIApp, Receive, Scope, Send

    ca_dir = certs.ca.parent
    second = pki.issue_cert(ca_dir, "client", "second-tester", out_dir=tmp_path / "second")
    seen: list[str] = []

    def spy(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                seen.append(client_identity(scope))
            await app(scope, receive, send)

        return wrapped

    db = SAMPLES / "sample-gpu-node-01.db"
    s_mtls = settings(db, tmp_path / "tls", tls_cert=certs.node_cert, tls_key=certs.node_key, client_ca=certs.ca)

    async def main() -> None:
        async with running(s_mtls, verify=_client(certs), wrapper=spy) as srv:
            assert (await srv.get("/api/v1/health")).status_code == 200
            other = context.client_ssl_context(ca_cert=certs.ca, client_cert=second.cert, client_key=second.key)
            async with httpx.AsyncClient(verify=other, base_url=srv.bound.url) as c:
                assert (await c.get("/api/v1/health")).status_code == 200
                assert (await c.get("/api/v1/health")).status_code == 200  # same connection, same identity
        s_plain = settings(db, tmp_path / "tls-self")
        async with running(s_plain, wrapper=spy) as srv:
            assert (await srv.get("/api/v1/health")).status_code == 200

    trio.run(main)
    first, second_id = (
        "cert:organizationName=ingero,commonName=tester",
        "cert:organizationName=ingero,commonName=second-tester",
    )
    assert seen[0] == first and seen[1] == seen[2] == second_id
    assert seen[3] == "peer:127.0.0.1"
