"""The SQL guard: run one untrusted, read-only SQL statement against a trace database.

SQLite itself is the guard; keyword checks here exist only to give friendlier messages.

Layers, each sufficient on its own for what it covers:
1. the connection is read-only (``mode=ro`` or ``immutable``) and ``PRAGMA query_only`` is on;
2. an authorizer allows reads only: no writes, schema changes, ATTACH/DETACH, transactions,
   pragma writes, ``load_extension`` or file-reading functions; ``SQLITE_LIMIT_ATTACHED`` is 0;
3. exactly one statement (``sqlite3`` refuses several; the tail may only hold comments);
4. a deadline enforced by the progress handler (:class:`~ingero.store.budget.Deadline`);
5. a row cap reported as ``truncated``, a response byte cap, and ``SQLITE_LIMIT_LENGTH`` so no single
   value (``zeroblob(1e9)``) can be materialised.

Every limit comes from one :class:`~ingero.store.budget.QueryBudget` (defaults: 1000 rows, at most
10 000; 2 s). Nothing that names the database file is readable (``database_list`` is refused), so
remote clients never learn where it lives. SQLite errors are classified by ``sqlite_errorname``.

The progress handler only runs between VM instructions, so a single built-in call that is quadratic
in its inputs could run for minutes out of its reach: on guarded connections ``instr``, ``replace``,
``trim``/``ltrim``/``rtrim`` and ``printf``/``format`` are replaced by safe versions with SQLite's
semantics (:mod:`ingero.store.guard_functions`), ``json_patch`` is refused, and LIKE/GLOB patterns are
capped at ``MAX_PATTERN_CHARS``. Callers that must answer on time whatever happens (the agent API)
also run queries in threads they can abandon (:mod:`ingero.agent.api.workers`); ``cancel`` stops a query.

Each call opens its own connection, so queries can run in worker threads in parallel.
"""

from __future__ import annotations

import math
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ingero.errors import (
    QueryError,
    QueryRejectedError,
    QueryTimeoutError,
    QueryTooLargeError,
    UsageError,
)
from ingero.store import budget as limits
from ingero.store.budget import Checkpoint, Deadline, QueryBudget, errorname
from ingero.store.db import open_readonly, translate
from ingero.store.guard_functions import SafeFunctions

# the budget's limits under the spellings local callers use (guard.MAX_LIMIT, ...): declared in budget
DEFAULT_LIMIT = limits.DEFAULT_ROWS
MAX_LIMIT = limits.MAX_ROWS
DEFAULT_TIMEOUT_MS = limits.DEFAULT_TIMEOUT_MS
MAX_VALUE_BYTES = 1024 * 1024
MAX_SQL_CHARS = 100_000
MAX_PATTERN_CHARS = 200  # LIKE/GLOB pattern length (SQLite's default is 50 000)

# Pragmas that only read, allowed as statements (without a value) and as table-valued functions.
# (database_list is not one of them: it shows the database's file path.)
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
    {
        "load_extension",
        "readfile",
        "writefile",
        "edit",
        "fts3_tokenizer",
        "zipfile",
        "sqlar_uncompress",
        "json_patch",  # quadratic in the number of keys, inside one VM instruction
    }
)
# Eponymous virtual tables a query may read. SQLite reports their first use on a connection to the
# authorizer as an UPDATE of sqlite_master, so the ones a query names are set up before the
# authorizer is installed; any other (dbstat, pragma_journal_mode, ...) is refused.
TABLE_FUNCTIONS = frozenset(
    {"json_each", "json_tree"}
    | {f"pragma_{p}" for p in READ_PRAGMAS if p.endswith(("_info", "_xinfo", "_list"))}
    | {"pragma_compile_options"}
)
_TABLE_FUNC_RE = re.compile(r"\b(json_each|json_tree|pragma_[a-z_]+)\b", re.IGNORECASE)

# Authorizer action codes by name (the sqlite3 module's SQLITE_* constants mix them with result codes).
_ACTIONS = [
    "CREATE_INDEX",
    "CREATE_TABLE",
    "CREATE_TEMP_INDEX",
    "CREATE_TEMP_TABLE",
    "CREATE_TEMP_TRIGGER",
    "CREATE_TEMP_VIEW",
    "CREATE_TRIGGER",
    "CREATE_VIEW",
    "DELETE",
    "DROP_INDEX",
    "DROP_TABLE",
    "DROP_TEMP_INDEX",
    "DROP_TEMP_TABLE",
    "DROP_TEMP_TRIGGER",
    "DROP_TEMP_VIEW",
    "DROP_TRIGGER",
    "DROP_VIEW",
    "INSERT",
    "PRAGMA",
    "READ",
    "SELECT",
    "TRANSACTION",
    "UPDATE",
    "ATTACH",
    "DETACH",
    "ALTER_TABLE",
    "REINDEX",
    "ANALYZE",
    "CREATE_VTABLE",
    "DROP_VTABLE",
    "FUNCTION",
    "SAVEPOINT",
    "RECURSIVE",
]
_ACTION_NAMES = {
    getattr(sqlite3, f"SQLITE_{name}"): name.lower().replace("_", " ")
    for name in _ACTIONS
    if isinstance(getattr(sqlite3, f"SQLITE_{name}", None), int)
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
        if action == sqlite3.SQLITE_UPDATE and (arg1 or "").lower() in ("sqlite_master", "sqlite_schema"):
            return self._deny(
                "this table-valued function or virtual table is not allowed; allowed: "
                + ", ".join(sorted(TABLE_FUNCTIONS))
            )
        what = _ACTION_NAMES.get(action, f"action {action}")
        return self._deny(f"{what.upper()} is not allowed (read-only)")

    def _deny(self, why: str) -> int:
        if self.denied is None:
            self.denied = why
        return sqlite3.SQLITE_DENY


# a local caller's budget: the operator's ceiling is the hard one (the agent passes its own budget)
LOCAL_BUDGET = QueryBudget(max_timeout_ms=limits.MAX_TIMEOUT_MS)


def run_query(
    db_path: str | Path,
    sql: str,
    *,
    params: Sequence[Any] = (),
    limit: int | None = None,
    timeout_ms: int | None = DEFAULT_TIMEOUT_MS,
    budget: QueryBudget = LOCAL_BUDGET,
    max_bytes: int | None = None,
    max_limit: int | None = None,
    legacy_node: str | None = None,
    event_filter: str | None = None,
    cancel: threading.Event | None = None,
    checkpoint: Checkpoint | None = None,
) -> QueryResult:
    """Run ``sql`` read-only against ``db_path`` with every guard on. Thread-safe (own connection).

    ``limit``/``timeout_ms`` are what the query asked for; ``budget`` caps them (``max_bytes`` and
    ``max_limit`` are older spellings of its ``max_response_bytes``/``max_rows``). ``cancel``, when
    set from another thread, stops the query at its next progress check; ``checkpoint`` runs there
    too and may pause it (see :class:`~ingero.store.budget.Deadline`).
    """
    if max_bytes is not None or max_limit is not None:
        budget = replace(
            budget,
            max_response_bytes=max_bytes or budget.max_response_bytes,
            max_rows=min(max_limit or budget.max_rows, MAX_LIMIT),
        )
    row_cap = budget.rows(limit)
    budget_ms = budget.timeout_ms(timeout_ms)
    _precheck(sql)

    started = time.perf_counter()
    conn = open_readonly(db_path, legacy_node=legacy_node, event_filter=event_filter, check_same_thread=False)
    funcs = SafeFunctions(MAX_VALUE_BYTES)
    try:
        _lock_down(conn, funcs)
        deadline = Deadline(budget_ms, cancel, checkpoint)
        return _execute(conn, sql, params, row_cap, deadline, budget.max_response_bytes, started, db_path, funcs)
    finally:
        funcs.close()
        conn.close()


def _precheck(sql: str) -> None:
    if not isinstance(sql, str):
        raise UsageError("sql must be a string")
    if len(sql) > MAX_SQL_CHARS:
        raise QueryTooLargeError(f"SQL text is {len(sql)} characters; the limit is {MAX_SQL_CHARS}")
    head = _strip_comments(sql)
    if not head.strip():
        raise QueryRejectedError("empty query", hint="try: SELECT * FROM events LIMIT 10")
    if "\x00" in sql:
        raise QueryRejectedError("NUL character in SQL")
    if _several_statements(sql):
        raise QueryRejectedError("exactly one SQL statement is allowed", hint="remove everything after the first ';'")
    m = _WRITE_WORDS.match(head)
    if m:
        raise QueryRejectedError(
            f"{m.group(1).upper()} statements are not allowed: queries are read-only",
            hint="use SELECT (or WITH ... SELECT)",
        )


def _several_statements(sql: str) -> bool:
    """True when something other than comments follows the first complete statement."""
    at = sql.find(";")
    while at >= 0:
        if sqlite3.complete_statement(sql[: at + 1]):
            return bool(_strip_comments(sql[at + 1 :]).strip(" \t\r\n;"))
        at = sql.find(";", at + 1)
    return False


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


def _lock_down(conn: sqlite3.Connection, funcs: SafeFunctions) -> None:
    conn.execute("PRAGMA query_only = 1")
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_PATTERN_CHARS)
    conn.setlimit(sqlite3.SQLITE_LIMIT_WORKER_THREADS, 0)
    funcs.install(conn)


def _execute(
    conn: sqlite3.Connection,
    sql: str,
    params: Sequence[Any],
    row_cap: int,
    deadline: Deadline,
    max_bytes: int,
    started: float,
    db_path: str | Path,
    funcs: SafeFunctions,
) -> QueryResult:
    for name in {m.group(1).lower() for m in _TABLE_FUNC_RE.finditer(sql)} & TABLE_FUNCTIONS:
        conn.execute(f"SELECT * FROM {name} LIMIT 0").fetchall()  # name is from our allowlist
    auth = _Authorizer()
    conn.set_authorizer(auth)
    deadline.install(conn)

    try:
        cur = conn.execute(sql, tuple(params))
        columns = [d[0] for d in (cur.description or [])]
        rows: list[list[Any]] = []
        size = 2
        truncated_reason: str | None = None
        # one row at a time: a row may hold several 1 MB values, so never materialise a batch of them
        for raw in cur:
            if len(rows) == row_cap:  # a row past the cap exists: that is what "truncated" means
                truncated_reason = "rows"
                break
            row = [_jsonable(v) for v in raw]
            size += _row_bytes(row)
            if size > max_bytes:
                truncated_reason = "bytes"
                break
            rows.append(row)
    except sqlite3.ProgrammingError as e:  # raised by the sqlite3 module itself (e.g. unbound '?')
        raise QueryError(f"SQL error: {e}") from None
    except sqlite3.DatabaseError as e:
        raise _classify(e, auth, funcs, deadline, db_path) from None
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


def _classify(
    e: sqlite3.DatabaseError,
    auth: _Authorizer,
    funcs: SafeFunctions,
    deadline: Deadline,
    db_path: str | Path,
) -> Exception:
    """Map a SQLite error to the exception tree by its error name (never by its message)."""
    name = errorname(e)
    if auth.denied or name == "SQLITE_AUTH":
        return QueryRejectedError(auth.denied or "statement not allowed (read-only)")
    if funcs.error:
        return QueryTooLargeError(funcs.error)
    if name == "SQLITE_INTERRUPT":
        if deadline.cancelled:
            return QueryTimeoutError("query cancelled (the request went away or the agent is stopping)")
        return QueryTimeoutError(
            f"query stopped at its {deadline.budget_ms} ms time limit",
            hint="narrow it (WHERE timestamp > ..., fewer joins) or ask for a larger timeout_ms",
        )
    if name == "SQLITE_TOOBIG":
        return QueryTooLargeError(f"a value exceeds the {MAX_VALUE_BYTES}-byte cap: {e}")
    if name == "SQLITE_READONLY":
        return QueryRejectedError("statement attempted to write: queries are read-only")
    if isinstance(e, sqlite3.OperationalError | sqlite3.IntegrityError | sqlite3.DataError):
        return QueryError(f"SQL error: {e}")
    return translate(e, db_path)


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, float) and not math.isfinite(v):  # NaN and ±Inf are not JSON
        return None if math.isnan(v) else ("Inf" if v > 0 else "-Inf")
    return v


def _row_bytes(row: list[Any]) -> int:
    """Size of the row as JSON (exact for plain ASCII text, an upper bound otherwise)."""
    n = 2
    for v in row:
        if isinstance(v, str):
            n += len(v) + 3 if v.isascii() and v.isprintable() else 6 * len(v) + 3
        else:
            n += 25
    return n
