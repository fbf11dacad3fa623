"""Safe stand-ins for SQLite built-ins that one VM step can spend minutes in, for the SQL guard.

SQLite's progress handler runs between VM instructions, so a single built-in call that is quadratic in
its inputs is out of its reach: ``instr``/``replace``/``trim`` compare every position of X against all
of Y (two 1 MB arguments: minutes), and ``printf('%.*c', 1e9, 'x')`` spins over its precision even when
the result is over the length cap. :class:`SafeFunctions` registers versions with SQLite's semantics
(checked against the built-ins in the tests) that are linear, or that refuse sizes over the value cap,
on the guard's connection only.
"""

from __future__ import annotations

import math
import re
import sqlite3
from collections.abc import Callable

SQLValue = str | bytes | int | float | None


def _text(v: str | bytes | int | float) -> str:
    """SQLite's implicit conversion of a value to TEXT."""
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, float):
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        t = f"{v:.15g}"
        mantissa, e, exp = t.partition("e")
        if "." not in mantissa:
            mantissa += ".0"
        return mantissa + e + exp
    return str(v)


class SafeFunctions:
    """``instr``, ``replace``, ``trim``/``ltrim``/``rtrim`` with SQLite's semantics in linear time.

    SQLite's own versions compare every position of X against all of Y: two 1 MB arguments keep one VM
    instruction (which the progress handler cannot interrupt) busy for minutes.
    """

    def __init__(self, max_value_bytes: int) -> None:
        self.max_value_bytes = max_value_bytes
        self.error: str | None = None
        self._aux: sqlite3.Connection | None = None

    def install(self, conn: sqlite3.Connection) -> None:
        conn.create_function("instr", 2, self.instr, deterministic=True)
        conn.create_function("replace", 3, self.replace, deterministic=True)
        conn.create_function("printf", -1, self.printf, deterministic=True)
        conn.create_function("format", -1, self.printf, deterministic=True)
        for name, side in (("trim", 3), ("ltrim", 1), ("rtrim", 2)):
            trim = _trimmer(side)
            conn.create_function(name, 1, trim, deterministic=True)
            conn.create_function(name, 2, trim, deterministic=True)

    def instr(self, x: SQLValue, y: SQLValue) -> int | None:
        if x is None or y is None:
            return None
        if isinstance(x, bytes) and isinstance(y, bytes):
            return x.find(y) + 1
        return _text(x).find(_text(y)) + 1

    def replace(self, x: SQLValue, y: SQLValue, z: SQLValue) -> SQLValue:
        if x is None or y is None:
            return None
        tx, ty = _text(x), _text(y)
        if not ty:  # SQLite hands X back (numbers keep their type, blobs come back as text)
            return x if isinstance(x, int | float) else tx
        if z is None:
            return None
        tz = _text(z)
        if len(tz) > len(ty):
            grown = len(tx) + tx.count(ty) * (len(tz) - len(ty))
            if grown > self.max_value_bytes:
                self.error = f"replace() result would be {grown} characters; the cap is {self.max_value_bytes} bytes"
                raise ValueError(self.error)
        return tx.replace(ty, tz)

    def printf(self, *args: SQLValue) -> SQLValue:
        """SQLite's own printf, after refusing widths/precisions over the value cap: ``%.*c`` with a
        precision of 1e9 spins for seconds in one VM step even though its result is discarded."""
        if not args or args[0] is None:
            return None
        fmt = _text(args[0])
        sizes = [int(n or 0) for m in _FMT_NUMBERS.finditer(fmt) for n in m.groups()]
        if "*" in fmt:  # a width or precision taken from the arguments: check every numeric argument
            sizes += [_as_int(a) for a in args[1:]]
        if any(abs(n) > self.max_value_bytes for n in sizes):
            self.error = f"printf() width or precision over the {self.max_value_bytes}-byte value cap"
            raise ValueError(self.error)
        if self._aux is None:
            self._aux = sqlite3.connect(":memory:", check_same_thread=False)
            self._aux.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_value_bytes)
        marks = ",".join("?" * len(args))
        value: SQLValue = self._aux.execute(f"SELECT printf({marks})", args).fetchone()[0]
        return value

    def close(self) -> None:
        if self._aux is not None:
            self._aux.close()


def _trimmer(side: int) -> Callable[..., str | None]:
    """trim (side 3), ltrim (1) or rtrim (2); called with one argument, Y is a space as in SQLite."""

    def trim(x: SQLValue, y: SQLValue = " ") -> str | None:
        if x is None or y is None:
            return None
        tx, ty = _text(x), _text(y)
        if len(ty) <= 16:  # str.strip is fine for short sets
            return tx.strip(ty) if side == 3 else tx.lstrip(ty) if side == 1 else tx.rstrip(ty)
        chars = set(ty)
        start, end = 0, len(tx)
        if side & 1:
            while start < end and tx[start] in chars:
                start += 1
        if side & 2:
            while end > start and tx[end - 1] in chars:
                end -= 1
        return tx[start:end]

    return trim


_FMT_NUMBERS = re.compile(r"%[-+ 0#,!]*(\d*)(?:\.(\d*))?")


def _as_int(v: SQLValue) -> int:
    """What sqlite3_value_int64 makes of a printf argument (near enough to bound it)."""
    if isinstance(v, bool | int):
        return int(v)
    if isinstance(v, float):
        return int(v) if math.isfinite(v) else 0
    if isinstance(v, str | bytes):
        m = re.match(r"\s*[-+]?\d+", v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
        return int(m.group(0)) if m else 0
    return 0
