"""Read-only SQL over the fleet's history in ClickHouse: the guard's contract, enforced by the server.

The connection itself is read-only: every request carries ``readonly=1``, under which ClickHouse
refuses writes, DDL, changes of settings and (18.16 and later) table functions. Before the statement
leaves, a check on its text (comments and literals blanked out) refuses what a read-only server
would still run or what the answer cannot carry: more than one statement, a statement that is not a
``SELECT``/``WITH``, a ``FORMAT`` clause, a table function that reaches outside the store (``url()``,
``file()``, ``remote()``, ...), and ``system`` tables beyond :data:`ALLOWED_SYSTEM`. Limits are the
local guard's (:mod:`ingero.store.budget`): rows (``max_result_rows``, the answer cut at the limit and
marked truncated) and time (``max_execution_time``).
"""

from __future__ import annotations

import math
import re
import time

from ingero.clickhouse.client import ClickHouse
from ingero.errors import QueryRejectedError, QueryTooLargeError, UsageError
from ingero.store import budget as limits
from ingero.store.guard import MAX_SQL_CHARS, QueryResult

READONLY_SETTINGS = {"readonly": 1}
ALLOWED_SYSTEM = frozenset({"one", "tables", "columns"})  # the schema, for discovery; nothing about the server
# table functions that read or write outside the store (ClickHouse's list grows; readonly=1 is the backstop)
OUTSIDE_FUNCTIONS = frozenset(
    name.lower()
    for name in (
        "url", "urlCluster", "file", "fileCluster", "remote", "remoteSecure", "cluster", "clusterAllReplicas",
        "s3", "s3Cluster", "gcs", "hdfs", "hdfsCluster", "azureBlobStorage", "mysql", "postgresql", "jdbc",
        "odbc", "mongodb", "redis", "sqlite", "executable", "input", "merge", "dictionary", "iceberg",
        "deltaLake", "hudi", "view", "viewIfPermitted", "loop", "generateRandom",
    )
)  # fmt: skip
_FIRST = re.compile(r"\s*\(*\s*(select|with)\b", re.IGNORECASE)
_SYSTEM = re.compile(r"\bsystem\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_FORMAT = re.compile(r"\b(format|into\s+outfile)\b", re.IGNORECASE)


def blank_literals(sql: str) -> str:
    """``sql`` with comments removed and the insides of quotes ('…', "…", `…`) blanked (same length)."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if sql.startswith("--", i) or sql.startswith("#", i):
            end = sql.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(" " * (end - i))
            i = end
        elif ch in "'\"`":
            j = i + 1
            while j < n and sql[j] != ch:
                j += 2 if sql[j] == "\\" else 1
            j = min(j, n - 1)
            out.append(ch + " " * (j - i - 1) + ch)
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def check(sql: str) -> str:
    """The statement to send (a trailing ``;`` dropped); raises QueryRejectedError / QueryTooLargeError."""
    if len(sql) > MAX_SQL_CHARS:
        raise QueryTooLargeError(f"SQL text is {len(sql)} characters; the limit is {MAX_SQL_CHARS}")
    if "\x00" in sql:
        raise QueryRejectedError("NUL character in SQL")
    bare = blank_literals(sql)
    stripped = bare.rstrip().rstrip(";")
    if ";" in stripped:
        raise QueryRejectedError("exactly one SQL statement is allowed", hint="remove everything after the first ';'")
    if not stripped.strip():
        raise QueryRejectedError("empty query", hint="try: SELECT * FROM events LIMIT 10")
    if not _FIRST.match(stripped):
        word = stripped.split()[0].upper()
        raise QueryRejectedError(
            f"{word} statements are not allowed: queries are read-only", hint="use SELECT (or WITH ... SELECT)"
        )
    for m in _SYSTEM.finditer(stripped):
        if m.group(1).lower() not in ALLOWED_SYSTEM:
            raise QueryRejectedError(
                f"system.{m.group(1)} is not readable here",
                hint=f"system tables allowed: {', '.join(sorted(ALLOWED_SYSTEM))}",
            )
    for m in _CALL.finditer(stripped):
        if m.group(1).lower() in OUTSIDE_FUNCTIONS:
            raise QueryRejectedError(f"the table function {m.group(1)}() reaches outside the store")
    if _FORMAT.search(stripped):
        raise QueryRejectedError("FORMAT / INTO OUTFILE are not allowed", hint="use --json, --csv, --tsv or --nl")
    return sql[: len(stripped)]


def run_query(
    ch: ClickHouse, sql: str, *, limit: int | None = None, timeout_ms: int = limits.DEFAULT_TIMEOUT_MS
) -> QueryResult:
    """One read-only statement through ``ch`` (whose Distributed tables see the whole cluster)."""
    cap = limit if limit is not None else limits.DEFAULT_ROWS
    if cap < 1 or cap > limits.MAX_ROWS:
        raise UsageError(f"--limit {cap} is outside 1..{limits.MAX_ROWS}")
    statement = check(sql)
    settings: dict[str, str | int] = {
        **READONLY_SETTINGS,
        "max_execution_time": max(1, math.ceil(timeout_ms / 1000)),
        "max_result_rows": cap + 1,
        "result_overflow_mode": "break",
    }
    started = time.perf_counter()
    res = ch.select(statement, settings)
    elapsed = (time.perf_counter() - started) * 1000
    truncated = len(res.rows) > cap
    return QueryResult(
        res.columns,
        res.rows[:cap],
        truncated=truncated,
        truncated_reason="rows" if truncated else None,
        elapsed_ms=elapsed,
    )
