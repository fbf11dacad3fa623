"""``event_aggregates.node`` (schema 6): each node's minute counts kept apart, from the writer through
``ingero merge`` to explain's storage reasoning, and ``engine_metrics`` carried by ``ingero merge``.

The cluster here is two real recordings written through the StoreWriter, merged by ``merge_databases``:
``gpu-a`` stored only a quarter of its kernel launches (the rest counted in ``event_aggregates`` only),
``gpu-b`` stored every call. Same pid, same minutes: before schema 6 their counts shared one key.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from ingero.clickhouse.schema import BY_NAME, local_ddl
from ingero.demo.synth import LAUNCH
from ingero.explain.engine import ExplainReport, explain
from ingero.explain.ledger import LedgerRow
from ingero.explain.storage import MINUTE_NS, aggregate_scopes
from ingero.identity import Identity
from ingero.store.db import open_readonly, open_writable
from ingero.store.engine_metrics import summary
from ingero.store.merge import merge_databases
from ingero.store.schema import AGGREGATE_COLUMNS, INGERO_TABLES, SCHEMA_VERSION
from ingero.store.writer import StoreWriter
from tests.test_explain_ledger import BASE, PID, Loop, host_code

SAMPLED, FULL = "gpu-a", "gpu-b"
LAUNCHES = (LAUNCH[0], LAUNCH[1])


def _node(tmp_path: Path, node: str, seed: int, *, sampled: bool) -> tuple[Path, int]:
    """One node's recording; returns it and the launches it counted but did not store."""
    lp = Loop(seed)
    lp.rec.node = node
    lp.run(host_code, 0.16)
    if sampled:  # selective storage: 3 launches of 4 only counted
        launches = [e for e in lp.rec.events if (e[3], e[4]) == LAUNCHES]
        for e in launches[::4] + launches[1::4] + launches[2::4]:
            lp.rec.events.remove(e)
            lp.rec.unstored.append(e)
    return lp.write(tmp_path / f"{node}.db"), len(lp.rec.unstored)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("agg")
    a, unstored = _node(tmp, SAMPLED, 61, sampled=True)
    b, none = _node(tmp, FULL, 62, sampled=False)
    assert unstored > 1000 and none == 0
    merge_databases([a, b], tmp / "cluster.db")
    return {SAMPLED: a, FULL: b, "cluster": tmp / "cluster.db"}


def _explain(path: Path, node: str | None = None) -> ExplainReport:
    conn = open_readonly(path)
    try:
        return explain(conn, node=node)
    finally:
        conn.close()


def _threads(report: ExplainReport, node: str) -> dict[tuple[int | None, int | None], dict[str, int]]:
    rows: list[LedgerRow] = [r for r in report.ledger if r.node == node and r.tid is not None]
    return {(r.pid, r.tid): dict(r.buckets) for r in rows}


def _counts(path: Path) -> dict[str, tuple[int, int]]:
    conn = open_readonly(path)
    try:
        rows = conn.execute("SELECT node, sum(count), sum(stored) FROM event_aggregates GROUP BY node").fetchall()
    finally:
        conn.close()
    return {str(n): (int(c), int(s)) for n, c, s in rows}


def test_the_writer_fills_node_and_merge_keeps_each_nodes_counts(cluster: dict[str, Path]) -> None:
    a, b = _counts(cluster[SAMPLED]), _counts(cluster[FULL])
    assert set(a) == {SAMPLED} and set(b) == {FULL}
    assert a[SAMPLED][1] < a[SAMPLED][0] and b[FULL][1] == b[FULL][0]
    assert _counts(cluster["cluster"]) == {**a, **b}
    conn = open_readonly(cluster["cluster"])
    try:  # one pid, the same minutes and ops on both nodes: two rows per key, not one summed row
        shared = conn.execute(
            "SELECT count(*) FROM (SELECT bucket, source, op, pid FROM event_aggregates "
            "GROUP BY 1, 2, 3, 4 HAVING count(DISTINCT node) = 2)"
        ).fetchone()[0]
        assert shared > 0
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def test_each_nodes_ledger_takes_its_own_aggregates_in_a_merged_database(cluster: dict[str, Path]) -> None:
    merged = _explain(cluster["cluster"])
    assert set(merged.nodes) == {SAMPLED, FULL}
    for node in (SAMPLED, FULL):
        alone = _threads(_explain(cluster[node]), node)
        assert alone and _threads(merged, node) == alone, node  # the same ledger as on the node's own recording
        assert _threads(_explain(cluster["cluster"], node), node) == alone  # and explained alone
    (sampled,) = _threads(merged, SAMPLED).values()
    (full,) = _threads(merged, FULL).values()
    assert sampled["not_recorded"] > 0  # its unstored launches: never reported as an idle GPU
    assert full["not_recorded"] == 0  # its peer's unstored calls are not its own
    assert any(n.startswith(f"{SAMPLED}: selective storage") for n in merged.notes)
    assert not any(n.startswith(f"{FULL}: selective storage") for n in merged.notes)
    # the sampled node's launches get their true count (stored ones marked), its peer's are all stored
    launches = {o.node: o for o in merged.ops if (o.source, o.op) == LAUNCHES}
    counted = _counts(cluster[SAMPLED])[SAMPLED]
    stored = launches[SAMPLED].stored
    assert stored is not None and launches[SAMPLED].count - stored == counted[0] - counted[1] > 0
    assert launches[FULL].stored is None


def as_schema_5(path: Path) -> None:
    """Rewrite ``path`` as schema 5 left it: Ingero's event_aggregates (no node), counts summed per key."""
    cols = ", ".join(AGGREGATE_COLUMNS)
    start = INGERO_TABLES.index("CREATE TABLE IF NOT EXISTS event_aggregates")
    ingero_ddl = INGERO_TABLES[start : INGERO_TABLES.index("\n);", start) + 3]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(
        f"""
        CREATE TABLE old AS SELECT bucket, source, op, pid, sum(count) AS count, sum(stored) AS stored,
            sum(sum_dur) AS sum_dur, min(min_dur) AS min_dur, max(max_dur) AS max_dur, sum(sum_arg0) AS sum_arg0
            FROM event_aggregates GROUP BY 1, 2, 3, 4;
        DROP TABLE event_aggregates;
        {ingero_ddl};
        INSERT INTO event_aggregates({cols}) SELECT {cols} FROM old;
        DROP TABLE old;
        PRAGMA user_version = 5;
        """
    )
    conn.close()


def test_an_older_merge_claims_no_nodes_regime_read_only_or_migrated(cluster: dict[str, Path], tmp_path: Path) -> None:
    """A schema-5 cluster database summed both nodes' counts under one key: no node's regime can be told,
    neither read as it is nor after the migration (its rows keep node '')."""
    old = tmp_path / "old-cluster.db"
    shutil.copy(cluster["cluster"], old)
    as_schema_5(old)
    for migrated in (False, True):
        if migrated:
            open_writable(old).close()
            assert set(_counts(old)) == {""}
        conn = open_readonly(old)
        try:
            # read as it is: not used; migrated: each node's own rows, of which there are none
            want = {SAMPLED: SAMPLED, FULL: FULL} if migrated else {}
            assert aggregate_scopes(conn, [SAMPLED, FULL]) == want
            assert aggregate_scopes(conn, [SAMPLED]) == {k: v for k, v in want.items() if k == SAMPLED}
        finally:
            conn.close()
        for node in (None, SAMPLED):
            report = _explain(old, node)
            assert not any("selective storage" in n for n in report.notes)
            assert all(r.buckets["not_recorded"] == 0 for r in report.ledger)


def test_a_one_node_schema_5_recording_migrates_its_counts_to_its_node(
    cluster: dict[str, Path], tmp_path: Path
) -> None:
    old = tmp_path / "old-a.db"
    shutil.copy(cluster[SAMPLED], old)
    before = _counts(old)
    as_schema_5(old)
    conn = open_readonly(old)  # read as it is (readers never migrate): the database's only node's counts
    try:
        assert aggregate_scopes(conn, [SAMPLED]) == {SAMPLED: None}
    finally:
        conn.close()
    as_is = _threads(_explain(old), SAMPLED)
    open_writable(old).close()
    assert _counts(old) == before  # every count kept, now its node's
    assert _threads(_explain(old), SAMPLED) == as_is == _threads(_explain(cluster[SAMPLED]), SAMPLED)
    conn = sqlite3.connect(old)
    try:
        pk = [r[1] for r in sorted(conn.execute("PRAGMA table_info(event_aggregates)"), key=lambda r: r[5]) if r[5]]
        assert pk == ["bucket", "source", "op", "pid", "node"]
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'idx_aggregates_bucket'").fetchone() == (
            1,
        )
    finally:
        conn.close()


def test_merging_an_older_node_database_gives_its_counts_its_node(cluster: dict[str, Path], tmp_path: Path) -> None:
    old = tmp_path / "old-a.db"
    shutil.copy(cluster[SAMPLED], old)
    as_schema_5(old)
    merge_databases([old, cluster[FULL]], tmp_path / "m.db")
    assert _counts(tmp_path / "m.db") == {**_counts(cluster[SAMPLED]), **_counts(cluster[FULL])}


def test_ingero_samples_still_read(samples: Path) -> None:
    """Ingero's layout has no node in event_aggregates: its one-node files are their node's, its cluster
    file (its own merge) tells no node's (the samples are opened read-only, immutable)."""
    conn = open_readonly(samples / "sample-cluster.db")
    try:
        assert "node" not in {r[1] for r in conn.execute("PRAGMA table_info(event_aggregates)")}
        assert aggregate_scopes(conn, ["gpu-node-01", "gpu-node-02"]) == {}
        report = explain(conn)
        assert len(report.nodes) == 3
    finally:
        conn.close()
    conn = open_readonly(samples / "sample-gpu-node-01.db")
    try:
        assert aggregate_scopes(conn, ["gpu-node-01"]) == {"gpu-node-01": None}
        assert explain(conn).nodes == ["gpu-node-01"]
    finally:
        conn.close()


def test_clickhouse_columns_follow_the_schema() -> None:
    """The ClickHouse table takes node from SQLite now (declared once: no second node column)."""
    cols = BY_NAME["event_aggregates"].columns
    assert [c.name for c in cols] == [*AGGREGATE_COLUMNS, "node"] and all(c.in_sqlite for c in cols)
    assert local_ddl(BY_NAME["event_aggregates"], "db").count("`node`") == 1


def _engine_rows(node: str) -> list[tuple[int | str | float, ...]]:
    return [
        (BASE + s * 1_000_000_000, PID, "vllm", "vllm:num_requests_waiting", "", float(s if node == SAMPLED else 0))
        for s in range(5)
    ]


def test_merge_carries_engine_metrics_with_their_node(tmp_path: Path) -> None:
    paths = []
    for node in (SAMPLED, FULL):
        path = tmp_path / f"{node}.db"
        with StoreWriter(path, Identity(node)) as w:
            w.write_batch(
                [(BASE, PID, PID, *LAUNCHES, 8000, 0, 0, 0, 0, 0, 0)],
                aggregates=[(BASE - BASE % MINUTE_NS, *LAUNCHES, PID, 1, 1, 8000, 8000, 8000, 0)],
                engine_metrics=_engine_rows(node),
            )
        paths.append(path)
    merge_databases(paths, tmp_path / "m.db")
    conn = open_readonly(tmp_path / "m.db")
    try:
        per_node = conn.execute("SELECT node, count(*), sum(value) FROM engine_metrics GROUP BY node").fetchall()
        assert per_node == [(SAMPLED, 5, 10.0), (FULL, 5, 0.0)]
        (waiting,) = summary(conn, node=SAMPLED)
        assert waiting["node"] == SAMPLED and waiting["last"] == {"vllm:num_requests_waiting": 4.0}
    finally:
        conn.close()
    # a copy of a database merged already (--dedupe): its rows without an identity are not counted twice
    copy = tmp_path / "copy.db"
    shutil.copy(paths[0], copy)
    merge_databases([paths[0], copy], tmp_path / "d.db", dedupe=True)
    conn = open_readonly(tmp_path / "d.db")
    try:
        assert conn.execute("SELECT count(*) FROM engine_metrics").fetchone() == (5,)
        assert conn.execute("SELECT sum(count) FROM event_aggregates").fetchone() == (1,)
    finally:
        conn.close()
