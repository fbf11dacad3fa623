"""The one exception tree of ingero.

Every error a user can cause or meet derives from :class:`IngeroError`. Library errors (sqlite3,
ssl, httpx, yaml, bcc, OSError) are translated into these at each boundary, so that:

* the CLI prints ``ingero: error: <one line>`` and exits with :attr:`IngeroError.exit_code`
  (tracebacks only with ``--debug``);
* the agent API answers ``{"ok": false, "status": N, "error": "<one line>"}`` with
  ``N = IngeroError.http_status``.

Messages are one line a human can act on: say what failed and, where there is one, the fix.
"""

from __future__ import annotations


class IngeroError(Exception):
    """Base class: a failure with a one-line, actionable message."""

    exit_code: int = 1
    http_status: int = 500

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = " ".join(message.split())  # always one line
        self.hint = " ".join(hint.split()) if hint else None
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(IngeroError):
    """Bad flags or arguments."""

    exit_code = 2
    http_status = 400


class PortInUseError(IngeroError):
    """A listen port that another process holds (EADDRINUSE)."""

    def __init__(self, port: int, *, hint: str | None = None) -> None:
        self.port = port
        super().__init__(f"port {port} is in use", hint=hint)


class ConfigError(IngeroError):
    """Bad configuration: always names the file and the key."""

    exit_code = 2
    http_status = 500

    def __init__(self, path: str, key: str, problem: str, *, hint: str | None = None) -> None:
        self.path = path
        self.key = key
        super().__init__(f"{path}: {key}: {problem}", hint=hint)


# --- store -------------------------------------------------------------------------------------


class StoreError(IngeroError):
    """A database could not be opened, read or written."""


class DatabaseNotFoundError(StoreError):
    http_status = 404


class NotADatabaseError(StoreError):
    http_status = 422


class SchemaTooNewError(StoreError):
    """The database was written by a newer ingero than this one."""

    http_status = 409


class SchemaError(StoreError):
    """The database does not have the tables/columns ingero needs."""

    http_status = 409


class WriterLockedError(StoreError):
    """Another process is already recording into this database (one writer per database)."""

    http_status = 409


class DiskFullError(StoreError):
    """The database's disk is full and pruning the oldest events freed nothing: recording stops."""


class InvalidNodeNameError(UsageError):
    pass


# --- queries -----------------------------------------------------------------------------------


class QueryError(IngeroError):
    """A SQL query failed (syntax, unknown column, ...)."""

    exit_code = 2  # the statement is what needs fixing, wherever it ran (a local file or every node)
    http_status = 400


class QueryRejectedError(QueryError):
    """The SQL guard refused the statement (writes, ATTACH, several statements, ...)."""

    http_status = 403


class QueryTimeoutError(QueryError):
    """The query ran past its time limit and was stopped."""

    http_status = 408


class QueryTooLargeError(QueryError):
    """A value or the response exceeded a size cap."""

    http_status = 413


class UnknownOpError(UsageError):
    """An op name that is not in the ops catalog."""


# --- agent -------------------------------------------------------------------------------------


class TracingUnavailableError(IngeroError):
    """eBPF tracing cannot run here (no bcc, not root, no headers, ...)."""

    exit_code = 3


class TLSConfigError(IngeroError):
    """Certificates/keys missing, unreadable or inconsistent."""

    exit_code = 2


class AuthError(IngeroError):
    """Missing or wrong bearer token."""

    http_status = 401


class RequestError(IngeroError):
    """A malformed API request (bad JSON, wrong types, too large, ...)."""

    http_status = 400


class NotFoundError(RequestError):
    """No such API route."""

    http_status = 404


class MethodNotAllowedError(RequestError):
    """The route exists but not for this HTTP method."""

    http_status = 405


class BodyTooLargeError(RequestError):
    """The request body exceeds the agent's cap."""

    http_status = 413


class ToolNotFoundError(NotFoundError):
    """No tool of that name in the registry (:mod:`ingero.tools`)."""


class RateLimitedError(IngeroError):
    """A client called faster than its token bucket allows: retry after ``retry_after_s``."""

    http_status = 429

    def __init__(self, message: str, *, retry_after_s: int = 1, hint: str | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message, hint=hint)


class AgentBusyError(IngeroError):
    """The agent is saturated (every worker taken, the wait queue full): retry after ``retry_after_s``."""

    http_status = 503
    retry_after_s = 1


# --- ClickHouse (the fleet's history) ----------------------------------------------------------


class ClickHouseError(IngeroError):
    """A ClickHouse server answered with an error that is not about the statement (DDL, insert)."""

    exit_code = 5


class ClickHouseUnavailableError(ClickHouseError):
    """The server, or a shard behind its Distributed table, cannot be reached: shipping stalls and resumes."""


# --- fleet -------------------------------------------------------------------------------------


class FleetError(IngeroError):
    """Fan-out to the fleet failed as a whole."""


class NoNodeAnsweredError(FleetError):
    """Every node failed; the message lists each node's reason."""

    exit_code = 4
