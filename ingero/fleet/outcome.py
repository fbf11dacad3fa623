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
``error``       no         anything else
==============  =========  ======================================================================
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from ingero.config import NodeSpec
from ingero.fleet.skew import SkewEstimate


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

    @property
    def answered(self) -> bool:
        return self.kind in ANSWERED

    @property
    def addr(self) -> str:
        return self.spec.addr

    @property
    def label(self) -> str:
        """The best name for humans: the agent's identity, else the configured name, else host:port."""
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
            "node": self.node,
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


def _tls_reason(e: ssl.SSLError) -> str:
    text = getattr(e, "verify_message", None) or e.reason or str(e)
    text = str(text).lower().replace("_", " ")
    if isinstance(e, ssl.SSLCertVerificationError):
        if "hostname" in text or "ip address mismatch" in text:
            return f"TLS: the agent's certificate does not match its address ({text})"
        return f"TLS: cannot verify the agent's certificate: {text} (pass --ca-cert or set fleet.ca_cert)"
    if "certificate required" in text:
        return "TLS: the agent requires a client certificate (pass --client-cert/--client-key)"
    if "unknown ca" in text or "bad certificate" in text or "certificate unknown" in text:
        return f"TLS: the agent rejected our client certificate ({text})"
    if "wrong version number" in text or "record layer failure" in text or "packet length too long" in text:
        return "TLS: the agent does not speak TLS (started with --no-tls? use --plaintext)"
    if "protocol version" in text:
        return f"TLS: no common protocol version ({text}); ingero needs TLS 1.3"
    return f"TLS: {text}"


def classify(exc: BaseException, timeout_s: float, *, tls: bool = True, client_cert: bool = False) -> NodeFailure:
    """Translate a transport exception (httpx, ssl, OSError, trio) into a NodeFailure.

    ``tls``/``client_cert`` describe the connection: an mTLS agent that refuses a client's certificate
    under TLS 1.3 does so after the client considers the handshake done, and usually just closes the
    connection — which then reads as "disconnected without a response" on a fresh TLS connection.
    """
    if isinstance(exc, NodeFailure):
        return exc
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, ssl.SSLError):
            return NodeFailure(Kind.TLS, _tls_reason(e))
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return NodeFailure(
                Kind.REFUSED, "connection refused (is the agent running? ingero serve / ingero trace --listen)"
            )
    for e in chain:
        if isinstance(e, TimeoutError):
            return NodeFailure(Kind.TIMEOUT, "connect timed out")
        if isinstance(e, socket.gaierror):
            return NodeFailure(Kind.UNREACHABLE, f"cannot resolve host: {e.strerror or e}")
        if isinstance(e, OSError) and e.errno is not None and e.strerror:
            if isinstance(e, ConnectionResetError | BrokenPipeError | ConnectionAbortedError):
                continue
            return NodeFailure(Kind.UNREACHABLE, f"cannot connect: {e.strerror}")
    if isinstance(exc, httpx.TimeoutException):
        what = {
            httpx.ConnectTimeout: "connect",
            httpx.ReadTimeout: "answer",
            httpx.WriteTimeout: "send",
            httpx.PoolTimeout: "connection slot",
        }.get(type(exc), "answer")
        return NodeFailure(Kind.TIMEOUT, f"no {what} within {timeout_s:g}s")
    if isinstance(exc, httpx.RemoteProtocolError):
        text = str(exc).lower()
        if tls and "without sending a response" in text:
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
        if "incomplete" in text or "peer closed" in text or "without sending complete" in text:
            return NodeFailure(Kind.PROTOCOL, "the agent closed the connection mid-answer (answer cut off)")
        return NodeFailure(Kind.PROTOCOL, f"HTTP protocol error: {' '.join(str(exc).split())}")
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return NodeFailure(Kind.PROTOCOL, "the connection broke mid-answer")
    if isinstance(exc, httpx.ConnectError):
        text = " ".join(str(exc).split()) or "connection failed"
        return NodeFailure(Kind.UNREACHABLE, f"cannot connect: {text}")
    if isinstance(exc, httpx.HTTPError):
        return NodeFailure(Kind.ERROR, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
    if isinstance(exc, OSError):
        return NodeFailure(Kind.UNREACHABLE, f"cannot connect: {exc.strerror or exc}")
    return NodeFailure(Kind.ERROR, f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def failure_summary(outcomes: list[NodeOutcome]) -> str:
    """``a:1 timeout (no answer within 5s); b:2 refused (...)`` — for NoNodeAnsweredError."""
    return "; ".join(f"{o.display}: {o.kind} — {o.reason}" for o in outcomes if not o.answered)
