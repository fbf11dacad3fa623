"""The SQL guard against hostile SQL, through a real agent: every statement is rejected or stopped,
and the database files are byte-for-byte unchanged afterwards."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import trio

from ingero.errors import IngeroError
from ingero.identity import Identity
from ingero.store import guard
from ingero.store.budget import QueryBudget
from ingero.store.writer import StoreWriter
from tests.agent_servers import running, settings

REJECT = {400, 403, 413}  # refused before or while running: error, read-only guard, size cap
STOPPED = {408}  # stopped at the time limit
TRUNCATED = {200}  # stopped at the row or byte cap (must say truncated)
RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c)"


def corpus(canary: Path) -> list[tuple[str, set[int]]]:
    return attempts(canary) + RESOURCE_BOMBS


def attempts(canary: Path) -> list[tuple[str, set[int]]]:
    """Writes, attachments, pragmas, extensions and statement tricks: refused before any real work."""
    c = str(canary)
    return [
        # writes, schema changes, transactions
        ("DELETE FROM events", REJECT),
        ("INSERT INTO events(id, timestamp, pid, tid, source, op, duration) VALUES ('x:1', 1, 1, 1, 1, 1, 1)", REJECT),
        ("UPDATE events SET duration = 0", REJECT),
        ("REPLACE INTO sources VALUES (99, 'EVIL')", REJECT),
        ("INSERT OR IGNORE INTO sources VALUES (99, 'EVIL')", REJECT),
        ("DROP TABLE events", REJECT),
        ("CREATE TABLE evil(x)", REJECT),
        ("CREATE TEMP TABLE evil AS SELECT * FROM events", REJECT),
        ("CREATE INDEX evil ON events(pid)", REJECT),
        ("CREATE VIEW v AS SELECT 1", REJECT),
        ("CREATE VIRTUAL TABLE t USING fts5(x)", REJECT),
        ("CREATE TRIGGER t AFTER INSERT ON events BEGIN DELETE FROM events; END", REJECT),
        ("ALTER TABLE events ADD COLUMN evil", REJECT),
        ("WITH x AS (SELECT 1) DELETE FROM events", REJECT),
        ("WITH x AS (SELECT 1) INSERT INTO sources SELECT 99, 'EVIL' FROM x", REJECT),
        ("WITH x AS (SELECT 1) UPDATE sqlite_master SET sql = 'x'", REJECT),
        ("VACUUM", REJECT),
        (f"VACUUM INTO '{c}'", REJECT),
        ("REINDEX", REJECT),
        ("ANALYZE", REJECT),
        ("BEGIN IMMEDIATE", REJECT),
        ("SAVEPOINT s1", REJECT),
        # ATTACH / DETACH
        (f"ATTACH DATABASE '{c}' AS evil", REJECT),
        ("ATTACH ':memory:' AS m", REJECT),
        ("DETACH DATABASE main", REJECT),
        (f"SELECT 1; ATTACH '{c}' AS evil", REJECT),
        # pragma writes and non-read pragmas
        ("PRAGMA query_only = 0", REJECT),
        ("PRAGMA writable_schema = ON", REJECT),
        ("PRAGMA journal_mode = DELETE", REJECT),
        ("PRAGMA user_version = 99", REJECT),
        ("PRAGMA main.user_version = 99", REJECT),
        ("PRAGMA wal_checkpoint(TRUNCATE)", REJECT),
        ("PRAGMA temp_store_directory = '/tmp'", REJECT),
        ("PRAGMA mmap_size = 1000000000", REJECT),
        ("PRAGMA optimize", REJECT),
        ("SELECT * FROM pragma_journal_mode('delete')", REJECT),
        ("SELECT * FROM dbstat", REJECT),
        # extensions and file access
        ("SELECT load_extension('/lib/x86_64-linux-gnu/libc.so.6')", REJECT),
        ("SELECT readfile('/etc/passwd')", REJECT),
        (f"SELECT writefile('{c}', 'evil')", REJECT),
        ("SELECT fts3_tokenizer('simple')", REJECT),
        ("SELECT json_patch('{}', '{}')", REJECT),
        # several statements and comment tricks
        ("SELECT 1; DELETE FROM events", REJECT),
        ("SELECT 1;DROP TABLE events;--", REJECT),
        ("SELECT 1 -- a comment\n; DELETE FROM events", REJECT),
        ("SELECT 1; /* x */ DELETE FROM events", REJECT),
        ("/* hello */ DELETE FROM events", REJECT),
        ("-- comment\nDELETE FROM events", REJECT),
        ("  \n\tdElEtE FROM events", REJECT),
        ("DEL/**/ETE FROM events", REJECT),
        ("\ufeffDELETE FROM events", REJECT),
        ("SELECT 1\x00; DELETE FROM events", REJECT),
        ("SELECT * FROM sqlite_master; PRAGMA writable_schema = 1", REJECT),
    ]


RESOURCE_BOMBS: list[tuple[str, set[int]]] = [
    # runaway work
    (f"{RUNAWAY} SELECT count(*) FROM c", STOPPED),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION SELECT x+1 FROM c) SELECT max(x) FROM c", STOPPED),
    ("SELECT count(*) FROM events a, events b, events c, events d", STOPPED),
    ("SELECT * FROM events a, events b, events c ORDER BY random()", STOPPED),
    (f"{RUNAWAY} SELECT x FROM c", TRUNCATED),
    ("SELECT randomblob(900000) FROM events", TRUNCATED),
    # memory bombs
    ("SELECT randomblob(1000000000)", REJECT),
    ("SELECT zeroblob(1000000000)", REJECT),
    ("SELECT length(zeroblob(2000000000))", REJECT),
    ("SELECT printf('%.*c', 1000000000, 'x')", REJECT),
    ("SELECT replace(hex(zeroblob(400000)), '0', hex(zeroblob(400000)))", REJECT),
    ("WITH RECURSIVE c(x) AS (SELECT 'a' UNION ALL SELECT x || x FROM c) SELECT length(x) FROM c", REJECT),
    (f"SELECT group_concat(hex(randomblob(1000))) FROM ({RUNAWAY} SELECT x FROM c)", REJECT | STOPPED),
    ("SELECT glob('*[' || hex(zeroblob(5000)) || ']', hex(zeroblob(500000)))", REJECT),
    ("SELECT " + "(" * 5000 + "1" + ")" * 5000, REJECT),
    ("SELECT 1" + " " * 200_000, REJECT),
]


def fingerprint(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_hostile_corpus_gets_nothing_through(sample_copy: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary" / "stolen.db"
    canary.parent.mkdir()
    cases = corpus(canary)
    assert len(cases) >= 40
    db = sample_copy / "sample-gpu-node-01.db"
    before = fingerprint(sample_copy)
    s = settings(db, tmp_path / "tls", budget=QueryBudget(max_timeout_ms=300))
    outcomes: list[tuple[str, int, str]] = []

    async def main() -> None:
        async with running(s) as srv:
            for sql, expected in cases:
                r = await srv.post("/api/v1/query", json={"sql": sql})
                doc = r.json()
                outcomes.append((sql[:80], r.status_code, doc.get("error", "")))
                assert r.status_code in expected, (sql[:200], r.status_code, doc)
                if r.status_code == 200:
                    assert doc["truncated"] is True and doc["truncated_reason"] in ("rows", "bytes")
                else:
                    assert doc["ok"] is False and doc["status"] == r.status_code
            # and the agent still answers ordinary SQL
            r = await srv.post("/api/v1/query", json={"sql": "SELECT count(*) AS n FROM events"})
            assert r.json()["rows"] == [[200]]

    trio.run(main)
    assert fingerprint(sample_copy) == before
    assert not canary.exists() and list(canary.parent.iterdir()) == []
    writes = [o for o in outcomes if o[1] == 403]
    assert any("read-only" in o[2] for o in writes) and any("one SQL statement" in o[2] for o in writes)


def test_quadratic_functions_answer_at_once(samples: Path, tmp_path: Path) -> None:
    """instr/replace/trim on 1 MB arguments would keep one uninterruptible VM step busy for minutes;
    the guard's linear versions answer correctly within the query budget instead."""
    db = samples / "sample-gpu-node-01.db"
    big = "hex(zeroblob(500000))"  # 1 000 000 '0' characters
    checks = [
        (f"SELECT instr({big}, hex(zeroblob(250000)) || '1')", [[0]]),
        (f"SELECT length(replace({big}, hex(zeroblob(200000)) || '1', 'x'))", [[1_000_000]]),
        (
            "SELECT length(ltrim(replace(hex(zeroblob(50000)), '0', 'a'), replace(hex(zeroblob(25000)), '0', 'b') || 'a'))",
            [[0]],
        ),
        (
            "SELECT instr('abcabc', 'ca'), replace('a.b.c', '.', '::'), trim('xxhixx', 'x'), rtrim(12.50, '0')",
            [[3, "a::b::c", "hi", "12.5"]],
        ),
    ]
    for sql, rows in checks:
        assert guard.run_query(db, sql, timeout_ms=2000).rows == rows, sql


def test_guard_on_a_live_database_changes_nothing(tmp_path: Path) -> None:
    """A database a writer still has open (WAL present) is read with mode=ro: still nothing gets in."""
    db = tmp_path / "live.db"
    with StoreWriter(db, Identity("live-node")) as w:
        sid = w.start_session({"flags": "test"})
        w.write_batch([(1_775_218_723_000_000_000 + i, 7, 7, 1, 1, 1000 + i, 0, 0, 0, 0, 0, 0) for i in range(500)])
        assert Path(str(db) + "-wal").exists()
        state = _logical_state(db)
        for sql, expected in attempts(tmp_path / "stolen.db"):
            try:
                guard.run_query(db, sql, timeout_ms=300)
            except IngeroError:  # every refusal is fine here; any other exception fails the test
                continue
            assert 200 in expected, f"ran on a live database but must be refused: {sql[:200]}"
        assert _logical_state(db) == state
        assert guard.run_query(db, "SELECT count(*) FROM events").rows == [[500]]
        w.end_session(sid, {})
    assert not (tmp_path / "stolen.db").exists()


def _logical_state(db: Path) -> tuple[object, ...]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return (
            conn.execute("SELECT count(*), total(duration) FROM events").fetchone(),
            conn.execute("SELECT group_concat(sql, ';') FROM sqlite_master").fetchone(),
            conn.execute("PRAGMA user_version").fetchone(),
            conn.execute("SELECT count(*) FROM sources").fetchone(),
        )
    finally:
        conn.close()
