"""A small ClickHouse client over its HTTP interface (httpx, synchronous): statements, selects, inserts.

Settings travel as URL parameters, the statement in the body (or, for an insert, in the ``query``
parameter with the rows in the body). Errors are translated by type: httpx's transport failures and
the server's exception code (the ``X-ClickHouse-Exception-Code`` header of current releases, else the
``Code: N`` that starts every error body, 18.16 included) — never by the wording of a message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from ingero.errors import (
    ClickHouseError,
    ClickHouseUnavailableError,
    QueryError,
    QueryRejectedError,
    QueryTimeoutError,
    QueryTooLargeError,
    UsageError,
)

DEFAULT_TIMEOUT_S = 30.0
_CODE = re.compile(rb"\s*Code:\s*(\d+)")

# ClickHouse error codes (src/Common/ErrorCodes.cpp), stable across releases.
READONLY = 164
TIMEOUT_EXCEEDED = 159
TOO_MANY_ROWS_OR_BYTES = 396
UNAVAILABLE = frozenset(
    {
        209,  # SOCKET_TIMEOUT
        210,  # NETWORK_ERROR
        279,  # ALL_CONNECTION_TRIES_FAILED
        519,  # NO_AVAILABLE_REPLICA (not in 18.16)
        1000,  # POCO_EXCEPTION (connection reset while sending to a shard)
    }
)
ACCESS = frozenset({164, 497, 516})  # READONLY, ACCESS_DENIED, AUTHENTICATION_FAILED


@dataclass
class Result:
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]


def check_url(url: str) -> str:
    u = httpx.URL(url)
    if u.scheme not in ("http", "https") or not u.host:
        raise UsageError(f"--clickhouse {url!r} is not an http(s) URL", hint="e.g. http://127.0.0.1:8123")
    return url.rstrip("/") + "/"


class ClickHouse:
    """One server's HTTP interface. ``settings`` apply to every request (e.g. ``readonly=1``)."""

    def __init__(
        self,
        url: str,
        *,
        settings: Mapping[str, str | int] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url = check_url(url)
        self.settings = dict(settings or {})
        auth = httpx.BasicAuth(user, password or "") if user else None
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)), auth=auth, trust_env=False
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ClickHouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, params: Mapping[str, str | int], body: bytes | str) -> bytes:
        merged = {**self.settings, **params}
        if "readonly" in merged:  # last: the request's other settings are applied before it takes effect
            merged["readonly"] = merged.pop("readonly")
        try:
            r = self._http.post(self.url, params={k: str(v) for k, v in merged.items()}, content=body)
        except httpx.TimeoutException as e:
            raise ClickHouseUnavailableError(f"ClickHouse at {self.url} timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ClickHouseUnavailableError(f"cannot reach ClickHouse at {self.url}: {type(e).__name__}") from None
        if r.status_code != 200:
            raise _translate(r)
        return r.content

    def execute(self, sql: str, settings: Mapping[str, str | int] | None = None) -> str:
        """Run one statement; its text output."""
        return self._post(dict(settings or {}), sql).decode("utf-8", "replace")

    def select(self, sql: str, settings: Mapping[str, str | int] | None = None) -> Result:
        """Run one SELECT; columns, ClickHouse types and rows (64-bit integers as numbers)."""
        params: dict[str, str | int] = {
            "default_format": "JSONCompact",
            "output_format_json_quote_64bit_integers": 0,
            **(settings or {}),
        }
        raw = self._post(params, sql)
        try:
            doc = json.loads(raw)
            meta = doc["meta"]
            return Result([m["name"] for m in meta], [m["type"] for m in meta], doc["data"])
        except (ValueError, KeyError, TypeError):
            raise ClickHouseError(
                "ClickHouse answered something other than JSONCompact", hint="remove any FORMAT clause"
            ) from None

    def insert(
        self, table: str, columns: tuple[str, ...], tsv: bytes, settings: Mapping[str, str | int] | None = None
    ) -> None:
        """Insert TabSeparated rows (one block) into ``table``."""
        cols = ", ".join(f"`{c}`" for c in columns)
        self._post({"query": f"INSERT INTO {table} ({cols}) FORMAT TabSeparated", **(settings or {})}, tsv)

    def ping(self) -> bool:
        try:
            return self._http.get(self.url + "ping").status_code == 200
        except httpx.HTTPError:
            return False


def ch_literal(v: Any) -> str:
    """A ClickHouse SQL literal of a value read from SQLite (NULL, a number, or a quoted string)."""
    if v is None:
        return "NULL"
    if isinstance(v, int | float):
        return repr(v)
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def exception_code(r: httpx.Response) -> int | None:
    header = r.headers.get("X-ClickHouse-Exception-Code")
    if header and header.isdigit():
        return int(header)
    m = _CODE.match(r.content[:64])
    return int(m.group(1)) if m else None


def _translate(r: httpx.Response) -> Exception:
    code = exception_code(r)
    text = " ".join(r.content[:600].decode("utf-8", "replace").split())
    if code in UNAVAILABLE:
        return ClickHouseUnavailableError(f"ClickHouse cluster unavailable: {text}")
    if code in ACCESS:
        return QueryRejectedError(f"refused by ClickHouse (read-only connection): {text}")
    if code == TIMEOUT_EXCEEDED:
        return QueryTimeoutError(f"ClickHouse stopped the query at its time limit: {text}")
    if code == TOO_MANY_ROWS_OR_BYTES:
        return QueryTooLargeError(f"ClickHouse result too large: {text}")
    if code is None and r.status_code >= 500:
        return ClickHouseUnavailableError(f"ClickHouse answered HTTP {r.status_code}: {text}")
    if code is None:
        return ClickHouseError(f"ClickHouse answered HTTP {r.status_code}: {text}")
    return QueryError(f"ClickHouse: {text}")
