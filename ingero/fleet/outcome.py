"""How one node's part of a fan-out ended, and the translation of transport errors into that.

Every node of a fan-out ends as exactly one :class:`NodeOutcome`; a failure is data, never an
exception that could cancel the other nodes. Kinds:

==============  =========  ======================================================================
kind            answered   meaning
==============  =========  ======================================================================
``ok``          yes        the agent answered in full
``truncated``   yes        the agent answered, but capped its rows (``--limit``, byte cap)
``timeout``     no         no complete answer within the per-node timeout (hung, black-holed, slow)
``refused``     no         TCP connection refused (no agent listening)
``unreachable`` no         name does not resolve, no route, network down
``tls``         no         TLS handshake failed (unknown CA, name mismatch, client cert rejected)
``auth``        no         the agent answered 401/403 (token missing or wrong)
``http``        no         any other non-2xx answer (with the agent's one-line error)
``schema``      no         the answer does not match the API contract or the fleet's columns
``protocol``    no         the connection broke mid-answer (cut-off body), or the body is not JSON
``too_large``   no         the answer passed the per-answer cap or the fan-out's shared byte budget
``duplicate``   no         the same agent instance as another entry of the list (listed twice, or reached at
                           two addresses): its answer is counted once
``error``       no         anything else
==============  =========  ======================================================================
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import trio

from ingero.config import NodeSpec
from ingero.fleet.budget import BudgetExceeded
from ingero.fleet.skew import SkewEstimate
from ingero.fleet.transport import (
    AnswerCutOff,
    AnswerTooLarge,
    ClosedBeforeAnswer,
    ConnectFailed,
    ConnectTimedOut,
    MalformedAnswer,
    ReadBroke,
    ReadTimedOut,
    SendFailed,
    SendTimedOut,
)


class Kind(StrEnum):
    OK = "ok"
    TRUNCATED = "truncated"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    TLS = "tls"
    AUTH = "auth"
    HTTP = "http"
    SCHEMA = "schema"
    PROTOCOL = "protocol"
    TOO_LARGE = "too_large"
    DUPLICATE = "duplicate"
    ERROR = "error"


ANSWERED = frozenset({Kind.OK, Kind.TRUNCATED})


class NodeFailure(Exception):
    """Raised inside a node's task to end it with a failed outcome (never escapes the fan-out)."""

    def __init__(self, kind: Kind, reason: str, *, status: int | None = None, node: str | None = None) -> None:
        self.kind = kind
        self.reason = " ".join(reason.split())
        self.status = status
        self.node = node
        super().__init__(self.reason)


@dataclass
class NodeOutcome:
    """One node's result: the answer (``data``) when it answered, else the kind and reason."""

    spec: NodeSpec
    kind: Kind
    node: str | None = None  # the agent's own identity (from its answers), when known
    reason: str = ""  # one line; for ``truncated`` the agent's truncation reason
    data: Any = None  # the job's result (e.g. the /query body)
    status: int | None = None  # HTTP status of the failing answer, if any
    elapsed_ms: float = 0.0  # this node's wall time
    skew: SkewEstimate | None = None
    skew_error: str | None = None  # why no skew estimate, when none
    notes: list[str] = field(default_factory=list)
    instance: str | None = None  # the agent's instance id (from its answers), when it sends one
    twin: bool = False  # another instance of the fleet answered with the same name: labelled name@host:port

    @property
    def answered(self) -> bool:
        return self.kind in ANSWERED

    @property
    def addr(self) -> str:
        return self.spec.addr

    @property
    def label(self) -> str:
        """The best name for humans: the agent's identity (``name@host:port`` when another instance of the
        fleet shares its name), else the configured name, else host:port."""
        if self.twin and self.node:
            return f"{self.node}@{self.spec.addr}"
        return self.node or self.spec.label

    @property
    def display(self) -> str:
        """``gpu-node-01 (10.0.0.1:8080)`` — name and address when they differ."""
        if self.label != self.spec.addr:
            return f"{self.label} ({self.spec.addr})"
        return self.spec.addr

    def as_dict(self) -> dict[str, Any]:
        return {
            "addr": self.spec.addr,
            "name": self.spec.name,
            "node": self.label if self.node else None,
            "agent_node": self.node,
            "instance": self.instance,
            "twin": self.twin,
            "outcome": str(self.kind),
            "answered": self.answered,
            "reason": self.reason or None,
            "status": self.status,
            "elapsed_ms": round(self.elapsed_ms, 3),
            "skew": self.skew.as_dict() if self.skew else None,
        }


class Outcomes:
    """``answered``/``failed`` for a fleet result that holds every node's outcome."""

    outcomes: list[NodeOutcome]

    @property
    def answered(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if o.answered]

    @property
    def failed(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if not o.answered]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts and the members of exception groups, each once."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        if e.__cause__ is not None:
            stack.append(e.__cause__)
        if e.__context__ is not None:
            stack.append(e.__context__)


# OpenSSL's X509_V_ERR_* codes (``SSLCertVerificationError.verify_code``) → what happened, and the fix.
_VERIFY_CODES: dict[int, str] = {
    9: "the agent's certificate is not valid yet (check this host's and the agent's clocks)",
    10: "the agent's certificate has expired (renew it: ingero cert node NAME --ca-dir DIR --force)",
    18: "cannot verify the agent's certificate: it is self-signed and not trusted (pass --ca-cert, or set "
    "fleet.ca_cert)",
    19: "cannot verify the agent's certificate: its chain ends in a CA this client does not trust "
    "(wrong --ca-cert / fleet.ca_cert?)",
    20: "cannot verify the agent's certificate: it was signed by a CA this client does not trust "
    "(wrong --ca-cert / fleet.ca_cert?)",
    21: "cannot verify the agent's certificate: unable to verify the first certificate (pass --ca-cert)",
    62: "the agent's certificate does not name the host dialled (add it with ingero cert node --san)",
    64: "the agent's certificate does not name the address dialled (add it with ingero cert node --san)",
}
# OpenSSL reason codes (``SSLError.reason``, a library identifier, not message text) → words.
_SSL_REASONS: dict[str, str] = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the agent requires a client certificate (pass --client-cert/--client-key)",
    "TLSV1_ALERT_UNKNOWN_CA": "the agent rejected our client certificate: signed by a CA it does not trust",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the agent rejected our client certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the agent rejected our client certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the agent rejected our client certificate: it has expired "
    "(renew it: ingero cert client NAME --ca-dir DIR --force)",
    "WRONG_VERSION_NUMBER": "the agent does not speak TLS (started with --no-tls? use --plaintext)",
    "RECORD_LAYER_FAILURE": "the agent does not speak TLS (started with --no-tls? use --plaintext)",
    "PACKET_LENGTH_TOO_LONG": "the agent does not speak TLS (started with --no-tls? use --plaintext)",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no common protocol version; ingero needs TLS 1.3 on both sides",
    "UNSUPPORTED_PROTOCOL": "no common protocol version; ingero needs TLS 1.3 on both sides",
}
_UNREACHABLE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETDOWN, errno.EADDRNOTAVAIL}


def _tls_failure(e: ssl.SSLError) -> NodeFailure:
    if isinstance(e, ssl.SSLCertVerificationError):
        words = _VERIFY_CODES.get(e.verify_code)
        if words is None:
            words = f"cannot verify the agent's certificate: {e.verify_message} (pass --ca-cert or set fleet.ca_cert)"
        return NodeFailure(Kind.TLS, f"TLS: {words}")
    words = _SSL_REASONS.get(str(e.reason or ""))
    return NodeFailure(Kind.TLS, f"TLS: {words or ' '.join(str(e).split())}")


def _os_failure(e: OSError, timeout_s: float) -> NodeFailure | None:
    if isinstance(e, ConnectionRefusedError):
        return NodeFailure(
            Kind.REFUSED, "connection refused (is the agent running? ingero serve / ingero trace --listen)"
        )
    if isinstance(e, socket.gaierror):
        return NodeFailure(Kind.UNREACHABLE, f"cannot resolve host: {e.strerror or 'unknown name'} (check --nodes)")
    if isinstance(e, TimeoutError):
        return NodeFailure(Kind.TIMEOUT, f"connect timed out within {timeout_s:g}s (black-holed or firewalled?)")
    if e.errno in _UNREACHABLE_ERRNOS:
        return NodeFailure(Kind.UNREACHABLE, f"cannot connect: {os.strerror(e.errno or 0)} (check the route)")
    return None


def classify(exc: BaseException, timeout_s: float, *, tls: bool = True, client_cert: bool = False) -> NodeFailure:
    """Translate a transport exception (the transport's own, ssl, OSError, trio) into a NodeFailure.

    Decided by exception type (and OpenSSL's/errno's codes), never by message text. ``tls`` and
    ``client_cert`` describe the connection: an mTLS agent that refuses a client's certificate under
    TLS 1.3 does so after the client considers the handshake done, and just closes the connection.
    """
    if isinstance(exc, NodeFailure):
        return exc
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, AnswerTooLarge):
            what = "the fan-out's shared answer budget" if e.shared else "the per-answer cap"
            return NodeFailure(
                Kind.TOO_LARGE,
                f"answer cut at {e.bytes_read // 1024} KiB: it would pass {what} of {e.limit // (1024 * 1024)} MiB "
                "(narrow the query or lower --limit)",
            )
        if isinstance(e, BudgetExceeded):
            return NodeFailure(
                Kind.TOO_LARGE,
                f"answer too large to parse within the fan-out's answer budget of {e.limit // (1024 * 1024)} MiB "
                "(narrow the query or lower --limit)",
            )
    for e in chain:
        if isinstance(e, ssl.SSLError):
            return _tls_failure(e)
    for e in chain:
        if isinstance(e, OSError) and not isinstance(e, ssl.SSLError):
            failure = _os_failure(e, timeout_s)
            if failure is not None:
                return failure
    if isinstance(exc, ClosedBeforeAnswer) and exc.tls and tls:
        if client_cert:
            return NodeFailure(
                Kind.TLS,
                "TLS: the agent closed the connection without answering: it refused our client certificate "
                "(signed by a CA the agent does not trust?)",
            )
        return NodeFailure(
            Kind.TLS,
            "TLS: the agent closed the connection without answering: it requires a client certificate "
            "(pass --client-cert/--client-key or set fleet.client_cert/client_key)",
        )
    if isinstance(exc, ClosedBeforeAnswer):
        return NodeFailure(Kind.PROTOCOL, "the agent closed the connection without answering")
    if isinstance(exc, AnswerCutOff):
        return NodeFailure(
            Kind.PROTOCOL, f"the agent closed the connection mid-answer (cut off after {exc.bytes_read} bytes)"
        )
    if isinstance(exc, MalformedAnswer):
        return NodeFailure(Kind.PROTOCOL, "the answer is not valid HTTP/1.1 (not an ingero agent on that port?)")
    if isinstance(exc, ConnectTimedOut):
        return NodeFailure(Kind.TIMEOUT, f"no connection within {timeout_s:g}s")
    if isinstance(exc, SendTimedOut):
        return NodeFailure(Kind.TIMEOUT, f"the agent did not take the request within {timeout_s:g}s")
    if isinstance(exc, ReadTimedOut | trio.TooSlowError):
        return NodeFailure(Kind.TIMEOUT, f"no answer within {timeout_s:g}s")
    if isinstance(exc, ReadBroke | SendFailed):
        return NodeFailure(Kind.PROTOCOL, "the connection broke mid-answer")
    if isinstance(exc, ConnectFailed):
        return NodeFailure(Kind.UNREACHABLE, "cannot connect")
    if isinstance(exc, OSError):
        return NodeFailure(Kind.UNREACHABLE, f"cannot connect: {exc.strerror or type(exc).__name__}")
    return NodeFailure(Kind.ERROR, f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def failure_summary(outcomes: list[NodeOutcome]) -> str:
    """``a:1 timeout (no answer within 5s); b:2 refused (...)`` — for NoNodeAnsweredError."""
    return "; ".join(f"{o.display}: {o.kind} — {o.reason}" for o in outcomes if not o.answered)
