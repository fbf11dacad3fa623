"""The guard's stand-ins for instr/replace/trim/printf answer exactly what SQLite's built-ins answer."""

from __future__ import annotations

import itertools
import sqlite3

import pytest

from ingero.store.guard_functions import SafeFunctions

VALUES = [
    "'abcabc'", "'bc'", "''", "NULL", "x'616263'", "x'63'", "12", "1.5", "1e20", "'  x  '", "' '", "'xa'",
    "'é日本é'", "'本'", "3.0", "-0.25", "1e-7", "123456789012345678", "0.1", "'1'", "'.'",
]  # fmt: skip
SHAPES = [
    ("instr", 2),
    ("replace", 3),
    ("trim", 1),
    ("trim", 2),
    ("ltrim", 1),
    ("ltrim", 2),
    ("rtrim", 1),
    ("rtrim", 2),
]
PRINTF = [
    "printf('%d %s %5.2f %%', 3, 'x', 3.14159)", "printf('%.*c', 5, 'x')", "printf(NULL)", "printf('%q', 'it''s')",
    "format('%-5s|', 'ab')", "printf('%*d', 4, 7)", "printf('%s', x'4142')", "printf(12)", "printf('%w', 'a\"b')",
    "printf('%!.20g', 0.1)", "printf('%x %o %e %c', 255, 8, 12345.678, 'q')", "printf('%,d', 1234567)",
]  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> tuple[sqlite3.Connection, sqlite3.Connection]:
    builtin = sqlite3.connect(":memory:")
    safe = sqlite3.connect(":memory:")
    SafeFunctions(1 << 20).install(safe)
    return builtin, safe


@pytest.mark.parametrize(("name", "arity"), SHAPES)
def test_same_answers_as_sqlite(pair: tuple[sqlite3.Connection, sqlite3.Connection], name: str, arity: int) -> None:
    builtin, safe = pair
    for args in itertools.product(VALUES, repeat=arity):
        sql = f"SELECT {name}({', '.join(args)})"
        assert safe.execute(sql).fetchone() == builtin.execute(sql).fetchone(), sql


def test_printf_same_answers(pair: tuple[sqlite3.Connection, sqlite3.Connection]) -> None:
    builtin, safe = pair
    for expr in PRINTF:
        assert safe.execute(f"SELECT {expr}").fetchone() == builtin.execute(f"SELECT {expr}").fetchone(), expr


def test_oversized_results_are_refused_not_built() -> None:
    conn = sqlite3.connect(":memory:")
    funcs = SafeFunctions(1 << 20)
    funcs.install(conn)
    for sql in (
        "SELECT replace(hex(zeroblob(400000)), '0', hex(zeroblob(400000)))",
        "SELECT printf('%.*c', 1000000000, 'x')",
        "SELECT printf('%.1000000000c', 'x')",
        "SELECT printf('%*d', '2000000000', 1)",
    ):
        funcs.error = None
        with pytest.raises(sqlite3.OperationalError):
            conn.execute(sql).fetchone()
        assert funcs.error and "cap" in funcs.error, sql
