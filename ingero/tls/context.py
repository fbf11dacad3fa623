"""TLS for the agent API: TLS 1.3-only SSL contexts (server and client) and the agent's own certificate.

* :func:`server_ssl_context` — TLS 1.3 minimum (a TLS 1.2 client fails the handshake), ALPN h2 and
  http/1.1, and with ``client_ca`` mutual TLS: a client without a certificate signed by that CA is
  refused during the handshake.
* :func:`client_ssl_context` — what the fleet client uses: TLS 1.3 minimum, verify against ``ca_cert``
  (or the system store), optional client certificate for mTLS, ``insecure`` for pinning callers.
* :func:`ensure_auto_cert` — with no certificate given, the agent makes (once) and then reuses an
  ECDSA P-256 self-signed certificate under ``~/.ingero/tls/`` (directory 0700, files 0600) whose SANs
  cover this host's names and addresses; clients trust it by its SHA-256 fingerprint or by using the
  certificate file as their CA.

ssl / OSError failures become :class:`~ingero.errors.TLSConfigError` with the file named.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import os
import socket
import ssl
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ingero.errors import TLSConfigError, UsageError

if TYPE_CHECKING:  # cryptography is imported where certificates are made or read: a client context needs only ssl
    from cryptography import x509

ALPN = ["h2", "http/1.1"]
AUTO_CERT = "server-cert.pem"
AUTO_KEY = "server-key.pem"
RENEW_BEFORE = dt.timedelta(days=30)
_SIOCGIFADDR = 0x8915


def default_tls_dir() -> Path:
    return Path.home() / ".ingero" / "tls"


# --- contexts ----------------------------------------------------------------------------------


def server_ssl_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_alpn_protocols(ALPN)
    _load_chain(ctx, cert, key)
    if client_ca is not None:
        _load_ca(ctx, client_ca, "--client-ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(
    ca_cert: str | Path | None = None,
    client_cert: str | Path | None = None,
    client_key: str | Path | None = None,
    insecure: bool = False,
    system_trust: bool = True,
) -> ssl.SSLContext:
    """TLS 1.3 client context. ``insecure`` skips verification (only for callers that pin a fingerprint).

    Without ``ca_cert`` it verifies against the system store; ``system_trust=False`` leaves loading that
    store (``load_default_certs``, ~25 ms) to the caller, who must do it before the first handshake.
    """
    if (client_cert is None) != (client_key is None):
        raise TLSConfigError("client certificate and client key go together", hint="give both or neither")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(ALPN)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif ca_cert is not None:
        _load_ca(ctx, Path(ca_cert).expanduser(), "CA certificate")
    elif system_trust:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if client_cert is not None and client_key is not None:
        _load_chain(ctx, Path(client_cert).expanduser(), Path(client_key).expanduser())
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    for p in (cert, key):
        if not p.is_file():
            raise TLSConfigError(
                f"{p}: no such file", hint="check --tls-cert/--tls-key (or make them: ingero cert node)"
            )
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
            raise TLSConfigError(f"{key} is not the key of {cert}") from None
        raise TLSConfigError(f"cannot load {cert} / {key}: {e.reason or e}") from None
    except OSError as e:
        raise TLSConfigError(f"cannot read {cert} / {key}: {e.strerror or e}") from None


def _load_ca(ctx: ssl.SSLContext, path: Path, what: str) -> None:
    if not path.is_file():
        raise TLSConfigError(f"{what} {path}: no such file")
    try:
        ctx.load_verify_locations(cafile=str(path))
    except ssl.SSLError as e:
        raise TLSConfigError(f"{what} {path} holds no usable certificate: {e.reason or e}") from None
    except OSError as e:
        raise TLSConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None


def cert_fingerprint(path: Path) -> str:
    from ingero.tls import pki

    return pki.fingerprint_sha256(pki.load_cert(path))


# --- the agent's own certificate ---------------------------------------------------------------


@dataclass(frozen=True)
class AutoCert:
    cert: Path
    key: Path
    fingerprint_sha256: str
    created: bool  # False: an existing one was reused


def ensure_auto_cert(tls_dir: Path | None = None, *, common_name: str, extra_names: Iterable[str] = ()) -> AutoCert:
    """Reuse the self-signed certificate in ``tls_dir`` when it is valid for a while yet and covers
    ``extra_names`` (the listen address); otherwise make a new one. Safe across processes (flock)."""
    from ingero.tls import pki

    d = (tls_dir or default_tls_dir()).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise TLSConfigError(f"cannot create {d}: {e.strerror or e}", hint="pass --tls-cert/--tls-key") from None
    cert_path, key_path = d / AUTO_CERT, d / AUTO_KEY
    wanted = [pki.parse_san(n) for n in extra_names if n]
    with _locked(d / ".lock"):
        existing = _reusable(cert_path, key_path, wanted)
        if existing is not None:
            return AutoCert(cert_path, key_path, pki.fingerprint_sha256(existing), created=False)
        names = host_sans()
        names += [n for n in wanted if n not in names]
        if common_name:
            try:
                n = pki.parse_san(common_name)
                if n not in names:
                    names.append(n)
            except UsageError:  # a node name that is no DNS name simply is not a SAN
                pass
        cert, key = pki.self_signed_server_cert(common_name or socket.gethostname(), names)
        try:
            pki.write_file(key_path, pki.key_pem(key))
            pki.write_file(cert_path, pki.cert_pem(cert))
        except OSError as e:
            raise TLSConfigError(f"cannot write {d}: {e.strerror or e}", hint="pass --tls-cert/--tls-key") from None
        return AutoCert(cert_path, key_path, pki.fingerprint_sha256(cert), created=True)


def _reusable(cert_path: Path, key_path: Path, wanted: list[x509.GeneralName]) -> x509.Certificate | None:
    from ingero.tls import pki

    if not cert_path.is_file() or not key_path.is_file():
        return None
    try:
        cert, key = pki.load_cert(cert_path), pki.load_key(key_path)
    except TLSConfigError:
        return None
    if cert.public_key() != key.public_key():
        return None
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_BEFORE:
        return None
    have = pki.sans_of(cert)
    if any(n not in have for n in wanted):
        return None
    return cert


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def host_sans() -> list[x509.GeneralName]:
    """This host's names and addresses: hostname, FQDN, localhost, loopback, every interface address."""
    from cryptography import x509

    from ingero.tls import pki

    names: list[str] = ["localhost"]
    for n in (socket.gethostname(), socket.getfqdn()):
        if n and n not in names:
            names.append(n)
    out: list[x509.GeneralName] = []
    for n in names:
        try:
            san = pki.parse_san(n)
        except UsageError:  # odd hostnames are skipped, not fatal
            continue
        if san not in out:
            out.append(san)
    for addr in host_addresses():
        ip = x509.IPAddress(addr)
        if ip not in out:
            out.append(ip)
    return out


def host_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    addrs: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [
        ipaddress.IPv4Address("127.0.0.1"),
        ipaddress.IPv6Address("::1"),
    ]

    def add(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
        if a not in addrs and not a.is_link_local and not a.is_unspecified:
            addrs.append(a)

    for _, name in _interfaces():
        v4 = _ipv4_of(name)
        if v4 is not None:
            add(v4)
    for v6 in _ipv6_addresses():
        add(v6)
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            add(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
    except (OSError, ValueError):
        pass
    return addrs


def _interfaces() -> list[tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except OSError:
        return []


def _ipv4_of(ifname: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return ipaddress.IPv4Address(res[20:24])


def _ipv6_addresses() -> list[ipaddress.IPv6Address]:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if parts and len(parts[0]) == 32:
            out.append(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
    return out
