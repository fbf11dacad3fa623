"""One error vocabulary for every tool surface, classified by exception type (never by message text).

=============  ======  ==================================================================
kind           status  raised as
=============  ======  ==================================================================
validation     400     pydantic ValidationError, UsageError, RequestError, QueryError
unauthorized   401     AuthError
refused        403     QueryRejectedError (the SQL guard's policy)
not_found      404     ToolNotFoundError, NotFoundError, DatabaseNotFoundError
method_not_a.  405     MethodNotAllowedError (GET on a tool, POST on the list)
timeout        408     QueryTimeoutError
too_large      413     QueryTooLargeError, BodyTooLargeError
rate_limited   429     RateLimitedError
unavailable    503     AgentBusyError, FleetError (no node answered)
internal       500     anything else (logged; a generic line to the caller)
=============  ======  ==================================================================

HTTP answers ``{"ok": false, "status": N, "kind": K, "error": "<one line>"}``; MCP answers
``isError`` with the text ``"K: <one line>"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ingero import errors as E

log = logging.getLogger("ingero.tools")

# (exception type, kind, status): the first match wins, so subclasses come before their bases
_TABLE: tuple[tuple[type[BaseException], str, int], ...] = (
    (E.ToolNotFoundError, "not_found", 404),
    (E.MethodNotAllowedError, "method_not_allowed", 405),
    (E.NotFoundError, "not_found", 404),
    (E.DatabaseNotFoundError, "not_found", 404),
    (E.AuthError, "unauthorized", 401),
    (E.QueryRejectedError, "refused", 403),
    (E.QueryTimeoutError, "timeout", 408),
    (E.QueryTooLargeError, "too_large", 413),
    (E.BodyTooLargeError, "too_large", 413),
    (E.RateLimitedError, "rate_limited", 429),
    (E.AgentBusyError, "unavailable", 503),
    (E.FleetError, "unavailable", 503),
    (E.UsageError, "validation", 400),
    (E.RequestError, "validation", 400),
    (E.QueryError, "validation", 400),
)
STATUS_OF_KIND = {kind: status for _, kind, status in _TABLE} | {"internal": 500}


@dataclass(frozen=True)
class Failure:
    kind: str
    status: int
    message: str
    retry_after_s: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": False, "status": self.status, "kind": self.kind, "error": self.message}

    def mcp_text(self) -> str:
        return f"{self.kind}: {self.message}"


def classify(exc: BaseException, *, tool: str = "") -> Failure:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return Failure("validation", 400, _validation_line(exc, tool))
    retry = getattr(exc, "retry_after_s", None)
    for typ, kind, status in _TABLE:
        if isinstance(exc, typ):
            assert isinstance(exc, E.IngeroError)
            return Failure(kind, status, exc.one_line(), retry if isinstance(retry, int) else None)
    if isinstance(exc, E.IngeroError):
        return Failure("failed", exc.http_status, exc.one_line())
    log.error("tool %s failed unexpectedly", tool or "?", exc_info=exc)
    return Failure("internal", 500, f"internal error in {tool or 'the tool'}; the server log has the details")


def _validation_line(exc: Any, tool: str) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "arguments"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return f"{tool + ': ' if tool else ''}invalid arguments: " + "; ".join(parts)
