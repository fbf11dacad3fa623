"""The SQL guard must not get in the way of reading: what analysts write runs, with caps reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.errors import QueryRejectedError, UsageError
from ingero.store import guard
from tests.conftest import SEED_QUERY

READS = [
    (SEED_QUERY, 8),
    (
        "SELECT e.id, s.name, o.name FROM events e JOIN sources s ON e.source = s.id JOIN ops o ON o.source_id = e.source AND o.op_id = e.op",
        600,
    ),
    ("WITH t AS (SELECT node, duration FROM events) SELECT node, max(duration) FROM t GROUP BY node", 3),
    ("SELECT node, duration, rank() OVER (PARTITION BY node ORDER BY duration DESC) AS r FROM events", 600),
    ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10) SELECT i FROM n", 10),
    ("PRAGMA table_info(events)", 18),
    ("PRAGMA main.table_info('causal_chains')", 13),
    ("SELECT name FROM pragma_table_info('events') WHERE pk", 1),
    ("SELECT count(*) FROM pragma_index_list('events')", 1),
    ("PRAGMA user_version", 1),
    ("PRAGMA page_count", 1),
    ("SELECT name, type FROM sqlite_master WHERE type = 'table'", None),
    ("SELECT j.value FROM causal_chains c, json_each(c.recommendations) j", None),
    ("SELECT json_extract(timeline, '$[0].layer') FROM causal_chains", 6),
    ("select * from events where op in (select op_id from ops where name like '%alloc%') -- trailing comment", None),
    ("SELECT 1;", 1),
    ("SELECT 1; -- just a comment after", 1),
    (
        "SELECT printf('%5.1f us', avg(duration) / 1000.0), replace(node, 'gpu-', ''), trim(' x ') FROM events GROUP BY node",
        3,
    ),
]


@pytest.mark.parametrize(("sql", "rows"), READS)
def test_reads_run(samples: Path, sql: str, rows: int | None) -> None:
    result = guard.run_query(samples / "sample-cluster.db", sql)
    assert result.columns
    if rows is not None:
        assert len(result.rows) == rows
    assert result.truncated is False


def test_row_and_byte_caps_say_truncated(samples: Path) -> None:
    db = samples / "sample-cluster.db"
    r = guard.run_query(db, "SELECT * FROM events", limit=599)
    assert len(r.rows) == 599 and r.truncated and r.truncated_reason == "rows"
    r = guard.run_query(db, "SELECT * FROM events", limit=600)
    assert len(r.rows) == 600 and not r.truncated
    r = guard.run_query(db, "SELECT * FROM events", limit=50_000)  # clamped to the maximum
    assert len(r.rows) == 600
    r = guard.run_query(db, "SELECT hex(zeroblob(10000)) FROM events", max_bytes=100_000)
    assert r.truncated_reason == "bytes" and 0 < len(r.rows) < 10 and r.notes
    with pytest.raises(UsageError):
        guard.run_query(db, "SELECT 1", limit=0)
    with pytest.raises(UsageError):
        guard.run_query(db, "SELECT 1", timeout_ms=0)


def test_guard_messages_name_the_problem(samples: Path) -> None:
    db = samples / "sample-gpu-node-01.db"
    with pytest.raises(QueryRejectedError, match="empty query"):
        guard.run_query(db, "  -- nothing\n /* here */ ")
    with pytest.raises(QueryRejectedError, match="PRAGMA integrity_check"):
        guard.run_query(db, "PRAGMA integrity_check")
    with pytest.raises(QueryRejectedError, match="allowed: json_each"):
        guard.run_query(db, "SELECT * FROM pragma_page_size()")
