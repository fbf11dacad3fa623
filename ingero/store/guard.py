"""The SQL guard: run one untrusted, read-only SQL statement against a trace database.

SQLite itself is the guard; keyword checks here exist only to give friendlier messages.

Layers, each sufficient on its own for what it covers:
1. the connection is read-only (``mode=ro`` or ``immutable``) and ``PRAGMA query_only`` is on;
2. an authorizer allows reads only: no writes, schema changes, ATTACH/DETACH, transactions,
   pragma writes, ``load_extension`` or file-reading functions; ``SQLITE_LIMIT_ATTACHED`` is 0;
3. exactly one statement (``sqlite3`` refuses several; the tail may only hold comments);
4. a deadline enforced by the progress handler (default 2 s; a caller may ask for less);
5. a row cap (default 1000, at most 10 000) reported as ``truncated``, a response byte cap, and
   ``SQLITE_LIMIT_LENGTH`` so no single value (``zeroblob(1e9)``) can be materialised.

Each call opens its own connection, so queries can run in worker threads in parallel.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingero.errors import (
    QueryError,
    QueryRejectedError,
    QueryTimeoutError,
    QueryTooLargeError,
    UsageError,
)
from ingero.store.db import open_readonly, translate

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
DEFAULT_TIMEOUT_MS = 2000
MAX_TIMEOUT_MS = 60_000
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_VALUE_BYTES = 1024 * 1024
MAX_SQL_CHARS = 100_000
PROGRESS_EVERY = 2000  # VM instructions between deadline checks

# Pragmas that only read, allowed as statements (without a value) and as table-valued functions.
READ_PRAGMAS = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
        "collation_list",
        "function_list",
        "database_list",
        "user_version",
        "schema_version",
        "page_count",
        "page_size",
        "freelist_count",
        "journal_mode",
        "encoding",
        "compile_options",
    }
)
DENIED_FUNCTIONS = frozenset(
    {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "zipfile", "sqlar_uncompress"}
)

_ACTION_NAMES = {
    getattr(sqlite3, name): name.removeprefix("SQLITE_").lower().replace("_", " ")
    for name in dir(sqlite3)
    if name.startswith("SQLITE_")
    and name not in ("SQLITE_OK", "SQLITE_DENY", "SQLITE_IGNORE")
    and not name.startswith("SQLITE_LIMIT")
    and isinstance(getattr(sqlite3, name), int)
}
_WRITE_WORDS = re.compile(
    r"^\s*(insert|update|delete|replace|create|drop|alter|attach|detach|vacuum|reindex|analyze|"
    r"begin|commit|rollback|savepoint|release)\b",
    re.IGNORECASE,
)


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False
    truncated_reason: str | None = None  # "rows" | "bytes"
    elapsed_ms: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "rows": self.rows,
            "truncated": self.truncated,
            "truncated_reason": self.truncated_reason,
            "elapsed_ms": round(self.elapsed_ms, 3),
        }


class _Authorizer:
    """SQLite authorizer callback that allows reading only and remembers why it said no."""

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _trig: str | None) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in DENIED_FUNCTIONS:
                return self._deny(f"function {arg2}() is not allowed")
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in READ_PRAGMAS and arg2 is None:
                return sqlite3.SQLITE_OK
            if name in READ_PRAGMAS and name.endswith(("_info", "_xinfo", "_list")):
                # table-valued forms (pragma_table_info('events')) pass their argument here
                return sqlite3.SQLITE_OK
            return self._deny(f"PRAGMA {arg1}{'=' + arg2 if arg2 else ''} is not allowed (read-only)")
        what = _ACTION_NAMES.get(action, f"action {action}")
        return self._deny(f"{what.upper()} is not allowed (read-only)")

    def _deny(self, why: str) -> int:
        if self.denied is None:
            self.denied = why
        return sqlite3.SQLITE_DENY


def clamp_limit(limit: int | None) -> int:
    if limit is None:
        return DEFAULT_LIMIT
    if limit < 1:
        raise UsageError(f"limit must be at least 1, got {limit}")
    return min(limit, MAX_LIMIT)


def run_query(
    db_path: str | Path,
    sql: str,
    *,
    params: Sequence[Any] = (),
    limit: int | None = DEFAULT_LIMIT,
    timeout_ms: int | None = DEFAULT_TIMEOUT_MS,
    max_bytes: int = MAX_RESPONSE_BYTES,
    max_limit: int = MAX_LIMIT,
    legacy_node: str | None = None,
    event_filter: str | None = None,
) -> QueryResult:
    """Run ``sql`` read-only against ``db_path`` with every guard on. Thread-safe (own connection)."""
    row_cap = min(clamp_limit(limit), max_limit)
    budget_ms = DEFAULT_TIMEOUT_MS if timeout_ms is None else timeout_ms
    if budget_ms <= 0:
        raise UsageError(f"timeout_ms must be positive, got {budget_ms}")
    budget_ms = min(budget_ms, MAX_TIMEOUT_MS)
    _precheck(sql)

    started = time.perf_counter()
    conn = open_readonly(db_path, legacy_node=legacy_node, event_filter=event_filter, check_same_thread=False)
    try:
        return _run(conn, sql, params, row_cap, budget_ms, max_bytes, started, db_path)
    finally:
        conn.close()


def _precheck(sql: str) -> None:
    if not isinstance(sql, str):
        raise UsageError("sql must be a string")
    if len(sql) > MAX_SQL_CHARS:
        raise QueryTooLargeError(f"SQL text is {len(sql)} characters; the limit is {MAX_SQL_CHARS}")
    if not _strip_comments(sql).strip():
        raise QueryRejectedError("empty query", hint="try: SELECT * FROM events LIMIT 10")
    if "\x00" in sql:
        raise QueryRejectedError("NUL character in SQL")
    m = _WRITE_WORDS.match(_strip_comments(sql))
    if m:
        raise QueryRejectedError(
            f"{m.group(1).upper()} statements are not allowed: queries are read-only",
            hint="use SELECT (or WITH ... SELECT)",
        )


def _strip_comments(sql: str) -> str:
    """Drop leading ``--`` and ``/* */`` comments (for the friendly keyword check only)."""
    s = sql.lstrip()
    while True:
        if s.startswith("--"):
            nl = s.find("\n")
            s = "" if nl < 0 else s[nl + 1 :].lstrip()
        elif s.startswith("/*"):
            end = s.find("*/")
            s = "" if end < 0 else s[end + 2 :].lstrip()
        else:
            return s


def _run(
    conn: sqlite3.Connection,
    sql: str,
    params: Sequence[Any],
    row_cap: int,
    budget_ms: int,
    max_bytes: int,
    started: float,
    db_path: str | Path,
) -> QueryResult:
    conn.execute("PRAGMA query_only = 1")
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
    auth = _Authorizer()
    conn.set_authorizer(auth)
    deadline = time.monotonic() + budget_ms / 1000.0
    conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, PROGRESS_EVERY)

    try:
        cur = conn.execute(sql, tuple(params))
        columns = [d[0] for d in (cur.description or [])]
        rows: list[list[Any]] = []
        size = 2
        truncated_reason: str | None = None
        while truncated_reason is None:
            # fetch at most one row past the cap: its presence is what "truncated" means
            chunk = cur.fetchmany(min(500, row_cap + 1 - len(rows)))
            if not chunk:
                break
            for raw in chunk:
                if len(rows) == row_cap:
                    truncated_reason = "rows"
                    break
                row = [_jsonable(v) for v in raw]
                size += _row_bytes(row)
                if size > max_bytes:
                    truncated_reason = "bytes"
                    break
                rows.append(row)
    except sqlite3.ProgrammingError as e:
        if "one statement" in str(e):
            raise QueryRejectedError(
                "exactly one SQL statement is allowed", hint="remove everything after the first ';'"
            ) from None
        raise QueryError(f"SQL error: {e}") from None
    except sqlite3.DatabaseError as e:
        raise _classify(e, auth, budget_ms, db_path) from None
    if conn.total_changes:  # belt and braces: nothing may ever change
        raise QueryRejectedError("statement attempted to modify the database")
    if not columns and not rows:
        raise QueryRejectedError("statement returned no result set", hint="use SELECT")
    notes = []
    if truncated_reason == "bytes":
        notes.append(f"response capped at {max_bytes} bytes")
    return QueryResult(
        columns=columns,
        rows=rows,
        truncated=truncated_reason is not None,
        truncated_reason=truncated_reason,
        elapsed_ms=(time.perf_counter() - started) * 1000.0,
        notes=notes,
    )


def _classify(e: sqlite3.DatabaseError, auth: _Authorizer, budget_ms: int, db_path: str | Path) -> Exception:
    msg = str(e)
    if auth.denied or "not authorized" in msg:
        return QueryRejectedError(auth.denied or "statement not allowed (read-only)")
    if "interrupted" in msg:
        return QueryTimeoutError(
            f"query stopped at its {budget_ms} ms time limit",
            hint="narrow it (WHERE timestamp > ..., fewer joins) or ask for a larger timeout_ms",
        )
    if "too big" in msg or "too large" in msg:
        return QueryTooLargeError(f"a value exceeds the {MAX_VALUE_BYTES}-byte cap: {msg}")
    if "attempt to write" in msg or "readonly" in msg:
        return QueryRejectedError("statement attempted to write: queries are read-only")
    if isinstance(e, sqlite3.OperationalError | sqlite3.IntegrityError | sqlite3.DataError):
        return QueryError(f"SQL error: {msg}")
    return translate(e, db_path)


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, float) and math.isnan(v):  # NaN is not JSON
        return None
    return v


def _row_bytes(row: list[Any]) -> int:
    n = 2
    for v in row:
        n += (len(v) + 3) if isinstance(v, str) else 21
    return n
