"""Certificates for the fleet with ``cryptography``: a fleet CA, node (server) and client certificates,
and the self-signed certificate an agent makes for itself when it is given none.

All keys are ECDSA P-256, written with mode 0600 (atomically: a temporary file, then a rename).
Certificates follow RFC 5280 closely enough for OpenSSL's strict verification (``VERIFY_X509_STRICT``):
CA certificates carry a critical basicConstraints and a key identifier, leaf certificates carry
authority and subject key identifiers, key usage and extended key usage.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ingero.errors import TLSConfigError, UsageError

CA_DAYS = 3650
LEAF_DAYS = 825
BACKDATE = dt.timedelta(hours=1)  # tolerate clocks that run behind across the fleet
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"

Kind = Literal["node", "client"]


@dataclass(frozen=True)
class IssuedFiles:
    """Where a certificate and its key were written."""

    cert: Path
    key: Path
    fingerprint_sha256: str
    subject: str
    sans: tuple[str, ...] = ()
    not_after: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "cert": str(self.cert),
            "key": str(self.key),
            "fingerprint_sha256": self.fingerprint_sha256,
            "subject": self.subject,
            "sans": list(self.sans),
            "not_after": self.not_after,
        }


# --- small helpers -----------------------------------------------------------------------------


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def fingerprint_sha256(cert: x509.Certificate | bytes) -> str:
    """SHA-256 of the DER certificate as ``AB:CD:...`` (what ``openssl x509 -fingerprint -sha256`` prints)."""
    der = cert if isinstance(cert, bytes) else cert.public_bytes(serialization.Encoding.DER)
    digest = hashes.Hash(hashes.SHA256())
    digest.update(der)
    return ":".join(f"{b:02X}" for b in digest.finalize())


def parse_san(text: str) -> x509.GeneralName:
    """``DNS:name``, ``IP:addr`` or a bare name/address (an address when it parses as one)."""
    t = text.strip()
    upper = t.upper()
    if upper.startswith("DNS:"):
        kind, value = "DNS", t[4:].strip()
    elif upper.startswith("IP:"):
        kind, value = "IP", t[3:].strip()
    else:
        kind, value = "", t
    if kind != "DNS":
        try:
            return x509.IPAddress(ipaddress.ip_address(value.strip("[]")))
        except ValueError:
            if kind == "IP":
                raise UsageError(f"--san {text}: not an IP address") from None
    if not value or len(value) > 253 or any(c.isspace() for c in value) or "/" in value:
        raise UsageError(f"--san {text!r}: not a DNS name or IP address", hint="e.g. --san gpu-node-01 --san 10.0.0.5")
    return x509.DNSName(value)


def split_sans(values: Iterable[str]) -> list[x509.GeneralName]:
    """Repeatable, comma-separated ``--san`` values → GeneralNames, duplicates dropped, order kept."""
    out: list[x509.GeneralName] = []
    for v in values:
        for part in v.split(","):
            if part.strip():
                name = parse_san(part)
                if name not in out:
                    out.append(name)
    return out


def sans_of(cert: x509.Certificate) -> list[x509.GeneralName]:
    try:
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []


def san_strings(cert: x509.Certificate) -> list[str]:
    sans = sans_of(cert)
    return [f"DNS:{n.value}" for n in sans if isinstance(n, x509.DNSName)] + [
        f"IP:{n.value}" for n in sans if isinstance(n, x509.IPAddress)
    ]


def _name(common_name: str, org: str = "ingero") -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write atomically with ``mode`` from the start (never world-readable, not even briefly)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise UsageError(f"{existing[0]} already exists", hint="pass --force to overwrite it, or pick another --out")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None


def load_cert(path: Path) -> x509.Certificate:
    data = _read(path, "certificate")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        try:
            return x509.load_der_x509_certificate(data)
        except ValueError:
            raise TLSConfigError(f"{path} is not a PEM or DER certificate") from None


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    data = _read(path, "key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise TLSConfigError(f"{path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSConfigError(f"{path}: expected an ECDSA key (made by 'ingero cert'), got {type(key).__name__}")
    return key


# --- building certificates ---------------------------------------------------------------------


def _builder(
    subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signing only; a CA also signs certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf_extensions(
    b: x509.CertificateBuilder, kind: Kind | Literal["self"], sans: Sequence[x509.GeneralName]
) -> x509.CertificateBuilder:
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if kind == "client" else ExtendedKeyUsageOID.SERVER_AUTH
    b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    b = b.add_extension(_key_usage(ca=False), critical=True)
    b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b


def self_signed_server_cert(
    common_name: str, sans: Sequence[x509.GeneralName], days: int = LEAF_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The agent's own certificate when it is given none (its SHA-256 fingerprint is what clients pin)."""
    key = new_key()
    name = _name(common_name, "ingero agent (self-signed)")
    b = _builder(name, name, key.public_key(), days)
    b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
    b = _leaf_extensions(b, "self", sans)
    return b.sign(key, hashes.SHA256()), key


def create_ca(out_dir: Path, name: str = "ingero fleet CA", *, days: int = CA_DAYS, force: bool = False) -> IssuedFiles:
    cert_path, key_path = out_dir / CA_CERT, out_dir / CA_KEY
    refuse_overwrite([cert_path, key_path], force)
    key = new_key()
    subject = _name(name)
    cert = (
        _builder(subject, subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _save(cert, key, cert_path, key_path)


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise UsageError(
            f"no CA in {ca_dir} (need {CA_CERT} and {CA_KEY})", hint="create one: ingero cert ca --out DIR"
        )
    cert, key = load_cert(cert_path), load_key(key_path)
    if cert.public_key() != key.public_key():
        raise TLSConfigError(f"{key_path} does not belong to {cert_path}")
    return cert, key


def issue_cert(
    ca_dir: Path,
    kind: Kind,
    name: str,
    sans: Sequence[x509.GeneralName] = (),
    *,
    out_dir: Path | None = None,
    days: int = LEAF_DAYS,
    force: bool = False,
) -> IssuedFiles:
    """A node (server) or client certificate signed by the CA in ``ca_dir``."""
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"bad certificate name {name!r}", hint="use a node or user name such as gpu-node-01")
    out = out_dir or ca_dir
    cert_path, key_path = out / f"{kind}-{name}.pem", out / f"{kind}-{name}-key.pem"
    refuse_overwrite([cert_path, key_path], force)
    ca_cert, ca_key = load_ca(ca_dir)
    if kind == "node" and not sans:
        sans = [parse_san(name)]
    key = new_key()
    b = _builder(_name(name), ca_cert.subject, key.public_key(), days)
    b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    b = _leaf_extensions(b, kind, sans)
    return _save(b.sign(ca_key, hashes.SHA256()), key, cert_path, key_path)


def describe(cert: x509.Certificate) -> dict[str, Any]:
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = bc.ca
    except x509.ExtensionNotFound:
        is_ca = False
    return {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "ca": is_ca,
        "sans": san_strings(cert),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "fingerprint_sha256": fingerprint_sha256(cert),
    }


def _save(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path, key_path: Path) -> IssuedFiles:
    """Write the key (0600) and the certificate (0644) into their directory (made 0700 when new)."""
    _make_dir(cert_path.parent)
    write_file(key_path, key_pem(key))
    write_file(cert_path, cert_pem(cert), 0o644)
    return IssuedFiles(
        cert=cert_path,
        key=key_path,
        fingerprint_sha256=fingerprint_sha256(cert),
        subject=cert.subject.rfc4514_string(),
        sans=tuple(san_strings(cert)),
        not_after=cert.not_valid_after_utc.isoformat(),
    )


def _make_dir(path: Path) -> None:
    existed = path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not existed:
            path.chmod(0o700)
    except OSError as e:
        raise UsageError(f"cannot create {path}: {e.strerror or e}") from None
