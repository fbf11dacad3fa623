"""Client settings for the fleet: one type, :class:`ClientSettings`, and one precedence rule.

**Precedence, for every setting: flag > environment > config file > default.** The config file's
``fleet:`` section is only read into :class:`~ingero.config.FleetConfig` (its parsed, validated
values); :func:`settings_from` is the one place that combines it with the environment
(``$INGERO_TOKEN``) and the explicit overrides (the CLI's ``--timeout``, ``--fanout``, ``--token``,
``--ca-cert``, ...) into the :class:`ClientSettings` everything downstream uses. :func:`build_ssl_context` builds the
one :class:`ssl.SSLContext` every connection of a fan-out shares (TLS 1.3 minimum, client
certificate for mTLS), and :func:`check_plaintext` refuses plain HTTP to non-loopback nodes unless it
was explicitly allowed.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ingero.config import FleetConfig, NodeSpec, is_loopback
from ingero.errors import TLSConfigError, UsageError
from ingero.fleet.budget import MAX_ANSWER_BYTES, MAX_TOTAL_BYTES
from ingero.timeutil import NS_PER_S, parse_duration

_DEFAULTS = FleetConfig()  # one set of defaults for the config file's fleet section and the client


@dataclass(frozen=True)
class ClientSettings:
    """Everything a :class:`~ingero.fleet.client.FleetClient` needs besides the node list."""

    timeout_s: float = _DEFAULTS.timeout_s  # per node, for its whole part of a fan-out
    fanout: int = _DEFAULTS.fanout  # nodes asked at once (CapacityLimiter)
    token: str | None = None  # bearer token
    ca_cert: str | None = None  # CA that signed the agents' certificates (None: system store)
    client_cert: str | None = None  # mTLS
    client_key: str | None = None
    plaintext: bool = False  # plain HTTP (agents started with --no-tls)
    allow_plaintext_remote: bool = False  # permit plain HTTP beyond loopback
    insecure_skip_verify: bool = False  # TLS without verifying the agents' certificates
    skew_samples: int = _DEFAULTS.skew_samples  # /time samples per node (0: no skew estimation)
    skew_threshold_ms: float = _DEFAULTS.skew_threshold_ms
    max_answer_bytes: int = MAX_ANSWER_BYTES  # one node's answer, at most
    max_total_bytes: int = MAX_TOTAL_BYTES  # all nodes' answers of one fan-out together (shared budget)
    config_path: str | None = None  # where the fleet section came from (for messages)

    @property
    def scheme(self) -> str:
        return "http" if self.plaintext else "https"

    @property
    def system_trust(self) -> bool:
        """Whether the agents' certificates are verified against the system store (no CA given)."""
        return not self.plaintext and self.ca_cert is None and not self.insecure_skip_verify

    def with_(self, **changes: object) -> ClientSettings:
        return replace(self, **changes)  # type: ignore[arg-type]


def settings_from(
    cfg: FleetConfig | None = None,
    *,
    config_path: str | Path | None = None,
    timeout: str | float | None = None,
    fanout: int | None = None,
    token: str | None = None,
    ca_cert: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    plaintext: bool = False,
    allow_plaintext_remote: bool = False,
    env: Mapping[str, str] | None = None,
) -> ClientSettings:
    """Flag > environment > config > default (see the module docstring); ``env`` defaults to ``os.environ``."""
    cfg = cfg or FleetConfig()
    env = os.environ if env is None else env
    timeout_s = cfg.timeout_s
    if timeout is not None:
        timeout_s = _timeout_seconds(timeout)
    width = cfg.fanout
    if fanout is not None:
        if fanout <= 0:
            raise UsageError(f"--fanout {fanout}: must be at least 1")
        width = fanout
    client_cert = client_cert or cfg.client_cert
    client_key = client_key or cfg.client_key
    if bool(client_cert) != bool(client_key):
        raise UsageError(
            "a client certificate needs its key (and the key its certificate)",
            hint="give both --client-cert and --client-key (or fleet.client_cert and fleet.client_key)",
        )
    for flag, path in (("--ca-cert", ca_cert), ("--client-cert", client_cert), ("--client-key", client_key)):
        if path and not os.access(Path(path).expanduser(), os.R_OK):
            raise TLSConfigError(f"{flag} {path}: cannot read the file")
    token = token or env.get("INGERO_TOKEN") or cfg.token or None
    if token is not None and (token != token.strip() or any(c in token for c in "\r\n\x00")):
        raise UsageError(
            "the bearer token holds a line break, a NUL or surrounding spaces",
            hint="check --token, $INGERO_TOKEN or fleet.token (a file read with $(cat ...) ends in a newline?)",
        )
    return ClientSettings(
        timeout_s=timeout_s,
        fanout=width,
        token=token,
        ca_cert=_expand(ca_cert or cfg.ca_cert),
        client_cert=_expand(client_cert),
        client_key=_expand(client_key),
        plaintext=plaintext or cfg.plaintext,
        allow_plaintext_remote=allow_plaintext_remote or cfg.allow_plaintext,
        insecure_skip_verify=cfg.insecure_skip_verify,
        skew_samples=cfg.skew_samples,
        skew_threshold_ms=cfg.skew_threshold_ms,
        config_path=str(config_path) if config_path else None,
    )


def _expand(path: str | None) -> str | None:
    return str(Path(path).expanduser()) if path else None


def _timeout_seconds(value: str | float) -> float:
    seconds = float(value) if isinstance(value, int | float) else parse_duration(value) / NS_PER_S
    if seconds <= 0:
        raise UsageError(f"--timeout {value}: must be positive", hint="e.g. --timeout 5s or --timeout 500ms")
    return seconds


def check_plaintext(nodes: Sequence[NodeSpec], settings: ClientSettings) -> None:
    """Refuse plain HTTP to non-loopback nodes unless explicitly allowed (nothing is sent)."""
    if not settings.plaintext or settings.allow_plaintext_remote:
        return
    remote = [n for n in nodes if not is_loopback(n.host)]
    if remote:
        more = f" and {len(remote) - 1} more" if len(remote) > 1 else ""
        raise UsageError(
            f"refusing plain HTTP to non-loopback node {remote[0].addr}{more}: queries and tokens would cross the "
            "network unencrypted",
            hint="use TLS (drop --plaintext), or pass --allow-plaintext-remote / set fleet.allow_plaintext: true",
        )


def build_ssl_context(settings: ClientSettings, *, defer_system_trust: bool = False) -> ssl.SSLContext | None:
    """The one client SSL context of a fan-out (None for plaintext).

    With ``defer_system_trust`` a context that verifies against the system store (``settings.system_trust``)
    comes without it: the caller loads it before the first handshake (:func:`load_system_trust`), so a
    fan-out whose nodes all refuse never parses it.
    """
    if settings.plaintext:
        return None
    from ingero.tls.context import client_ssl_context

    try:
        ctx = client_ssl_context(
            ca_cert=settings.ca_cert,
            client_cert=settings.client_cert,
            client_key=settings.client_key,
            insecure=settings.insecure_skip_verify,
            system_trust=not defer_system_trust,
        )
        ctx.set_alpn_protocols(["http/1.1"])  # the fan-out transport speaks HTTP/1.1
        return ctx
    except TLSConfigError:
        raise
    except (OSError, ssl.SSLError, ValueError) as e:
        where = settings.client_cert or settings.ca_cert or "client TLS"
        raise TLSConfigError(f"{where}: cannot load certificates: {' '.join(str(e).split())}") from None


def load_system_trust(ctx: ssl.SSLContext) -> None:
    """Load the system store into a context built with ``defer_system_trust``."""
    ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
