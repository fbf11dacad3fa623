"""The fleet's history in ClickHouse, on a real 2-shard cluster: two ``clickhouse-server`` processes on
127.0.0.1 (Debian's package, as CI installs it), each with its own config, data directory and free
ports, and a ``remote_servers`` cluster of both. Their own ports: a system service the package may have
started (8123/9000) is neither used nor disturbed.

Shipping three recordings through one server and reading through either; re-runs; a shard killed
mid-ship; a store down while a recording grows; the read-only query path; explain and stragglers on
stored rows against the same commands on the recordings.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ingero.cli.main import main
from ingero.clickhouse.client import ClickHouse
from ingero.clickhouse.progress import lag
from ingero.clickhouse.query import READONLY_SETTINGS
from ingero.clickhouse.schema import BY_NAME, TABLES
from ingero.clickhouse.shipper import Shipper, ShipResult
from ingero.errors import ClickHouseUnavailableError, QueryRejectedError
from ingero.identity import Identity
from ingero.store.engine_metrics import EngineMetricRow
from ingero.store.writer import StoreWriter
from tests.clickhouse_cluster import CLUSTER, SERVER_BIN, Server, local_cluster
from tests.collective_sim import Job, Rank, simulate, write_calls_db
from tests.conftest import SEED_QUERY, write_db
from tests.fleet_agents import straggler_events
from tests.test_inference import SCRAPES, T0, S, plateaus, series_db

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = [ROOT / "investigations" / f"sample-gpu-node-0{i}.db" for i in (1, 2, 3)]

pytestmark = [
    pytest.mark.clickhouse,
    pytest.mark.slow,  # two servers and seconds per test: out of the fast suite, in make test / CI
    pytest.mark.skipif(
        SERVER_BIN is None, reason="clickhouse-server is not installed (apt-get install clickhouse-server)"
    ),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    with local_cluster(tmp_path_factory.mktemp("clickhouse")) as servers:
        yield servers


def test_the_schema_applies_through_the_command(cluster: list[Server]) -> None:
    """``clickhouse-schema --apply`` on a running cluster: idempotent (IF NOT EXISTS) on every server."""
    assert main(["clickhouse-schema", "--cluster", CLUSTER, "--apply", ",".join(s.url for s in cluster)]) == 0
    with ClickHouse(cluster[0].url) as ch:
        engines = dict(ch.select("SELECT name, engine FROM system.tables WHERE database = 'default'").rows)
    for t in TABLES:
        assert (engines[t.name], engines[t.local]) == ("Distributed", "ReplacingMergeTree")


def _clear(cluster: list[Server]) -> None:
    for s in cluster:
        with ClickHouse(s.url) as ch:
            for t in TABLES:
                ch.execute(f"TRUNCATE TABLE IF EXISTS {t.local}")


@pytest.fixture
def store(cluster: list[Server]) -> Iterator[list[Server]]:
    """The cluster with empty tables (both servers up)."""
    for s in cluster:
        if s.proc is None:
            s.restart()
    _clear(cluster)
    yield cluster


def _copies(tmp: Path) -> list[Path]:
    out = []
    for src in SAMPLES:
        dst = tmp / src.name
        shutil.copyfile(src, dst)
        out.append(dst)
    return out


def _sqlite_counts(db: Path) -> dict[str, int]:
    conn = sqlite3.connect(db)
    try:
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return {t.name: conn.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0] for t in TABLES if t.name in have}
    finally:
        conn.close()


def _node(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("SELECT node FROM events LIMIT 1").fetchone()[0])
    finally:
        conn.close()


def _store_counts(url: str, node: str, table: str = "events") -> tuple[int, int]:
    """(rows, distinct identities) of one node in a table, through the Distributed table."""
    key = ", ".join(BY_NAME[table].key)
    with ClickHouse(url) as ch:
        rows = ch.select(f"SELECT count(), uniqExact({key}) FROM {table} WHERE node = '{node}'").rows
    return int(rows[0][0]), int(rows[0][1])


def _store_table_counts(url: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(node, table) -> (rows, distinct identities), every table through its Distributed table."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    with ClickHouse(url) as ch:
        for t in TABLES:
            sql = f"SELECT node, count(), uniqExact({', '.join(t.key)}) FROM {t.name} GROUP BY node"
            out.update({(r[0], t.name): (int(r[1]), int(r[2])) for r in ch.select(sql).rows})
    return out


def _ship(db: Path, url: str, *extra: str) -> None:
    assert main(["ship", "--db", str(db), "--clickhouse", url, *extra]) == 0


def test_schema_prints_local_and_distributed_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clickhouse-schema", "--cluster", "prod"]) == 0
    out = capsys.readouterr().out
    for t in TABLES:
        assert f"CREATE TABLE IF NOT EXISTS default.{t.local} (" in out
        assert (
            f"default.{t.name} AS default.{t.local} ENGINE = Distributed(prod, default, {t.local}, sipHash64(node))"
            in out
        )
    assert "`timestamp` Int64" in out and "ReplacingMergeTree()" in out and "ON CLUSTER" not in out
    assert main(["clickhouse-schema", "--cluster", "x; DROP TABLE events"]) == 2


def test_three_recordings_through_one_server_seen_through_either(
    store: list[Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dbs = _copies(tmp_path)
    for db in dbs:
        _ship(db, store[0].url)
    expected = {(_node(db), table): (n, n) for db in dbs for table, n in _sqlite_counts(db).items() if n}
    assert all(expected[(_node(db), "events")][0] > 5000 for db in dbs)
    for s in store:
        assert _store_table_counts(s.url) == expected, s.url
    # rows land on both shards, each node's on one
    per_shard = []
    for s in store:
        with ClickHouse(s.url) as ch:
            per_shard.append(
                {r[0]: r[1] for r in ch.select("SELECT node, count() FROM events_local GROUP BY node").rows}
            )
    assert all(per_shard), per_shard
    assert not set(per_shard[0]) & set(per_shard[1])
    assert set(per_shard[0]) | set(per_shard[1]) == {_node(db) for db in dbs}
    # shipping again, through the other server, changes nothing
    for db in dbs:
        with ClickHouse(store[1].url) as ch, Shipper(db, ch) as sh:
            assert sh.ship_once().rows == 0
        assert all(r.unshipped_rows == 0 for r in lag(db))
        n = _sqlite_counts(db)["events"]
        assert main(["ship", "--db", str(db), "--status", "--json"]) == 0
        status = {t["table"]: t for t in json.loads(capsys.readouterr().out)["tables"]}
        assert status["events"]["shipped_rows"] == n and status["events"]["unshipped_rows"] == 0
        assert _store_counts(store[1].url, _node(db)) == (n, n)


def test_older_layouts_ship_with_their_node(store: list[Server], tmp_path: Path) -> None:
    """A table an older layout has without ``node`` (``event_aggregates`` before schema 6, Ingero's
    ``system_snapshots``) is shipped with the recording's node, never an empty or made-up one."""
    from tests.conftest import SAMPLES as INGERO_SAMPLES
    from tests.test_store_aggregates import as_schema_5

    old = tmp_path / "old.db"
    shutil.copyfile(SAMPLES[1], old)
    as_schema_5(old)
    ingero = tmp_path / "ingero.db"
    shutil.copyfile(INGERO_SAMPLES / "sample-gpu-node-01.db", ingero)
    for db in (old, ingero):
        _ship(db, store[0].url)
    got = _store_table_counts(store[1].url)
    for db, node in ((old, "gpu-node-02"), (ingero, "gpu-node-01")):
        for table, n in _sqlite_counts(db).items():
            if n:
                assert got[(node, table)] == (n, n), (node, table)
    assert {node for node, _ in got} == {"gpu-node-01", "gpu-node-02"}


def _local_rows(url: str, node: str) -> int:
    with ClickHouse(url) as ch:
        return int(ch.select(f"SELECT count() FROM events_local WHERE node = '{node}'").rows[0][0])


def test_a_shard_killed_mid_ship_resumes_without_loss_or_duplicates(store: list[Server], tmp_path: Path) -> None:
    """Ship through server 1; kill server 2 (the other shard) between batches; the next batch fails for
    every node — for a node of server 1's shard possibly after its rows were written (18.16's synchronous
    insert may write the live shard's block, then report the dead one). Restarted, the shipper settles
    each unanswered batch by probing for it (found: done; absent: sent again) and ships the rest: exact
    counts, no duplicate."""
    entry, victim = store
    events = BY_NAME["events"]
    dbs = _copies(tmp_path)
    for db in dbs:
        with ClickHouse(entry.url) as ch, Shipper(db, ch, batch_rows=400) as sh:
            assert sh.ship_table(events, max_batches=1).rows == 400
    on_entry = {_node(db) for db in dbs if _local_rows(entry.url, _node(db))}
    assert on_entry and on_entry != {_node(db) for db in dbs}  # nodes on both shards
    victim.stop(kill=True)
    for db in dbs:
        with (
            ClickHouse(entry.url) as ch,
            Shipper(db, ch, batch_rows=400) as sh,
            pytest.raises(ClickHouseUnavailableError),
        ):
            sh.ship_table(events, max_batches=1)
    landed = {n: _local_rows(entry.url, n) == 800 for n in on_entry}  # the failed batch in the store all the same?
    assert set(map(_local_rows, [entry.url] * len(on_entry), on_entry)) <= {400, 800}
    victim.restart()
    outcomes = {}
    for db in dbs:
        with ClickHouse(entry.url) as ch, Shipper(db, ch, batch_rows=400) as sh:
            prog = sh.ship_table(events)
            outcomes[_node(db)] = (prog.settled, prog.resent)
        n = _sqlite_counts(db)["events"]
        assert _store_counts(victim.url, _node(db)) == (n, n)
    for node, (settled, resent) in outcomes.items():
        # found in the store: not sent twice; absent (the dead shard's, or never written): sent again
        assert (settled, resent) == ((1, 0) if landed.get(node) else (0, 1)), node


def test_a_table_pruned_empty_renumbers_and_is_still_shipped(store: list[Server], tmp_path: Path) -> None:
    """The disk budget may prune every event; SQLite then numbers the next rows from 1, below the cursor."""
    db = _copies(tmp_path)[0]
    node = _node(db)
    _ship(db, store[0].url)
    before = _sqlite_counts(db)["events"]
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM events")
    conn.commit()
    conn.close()
    _more_events(db, node, 700)
    assert sqlite3.connect(db).execute("SELECT max(rowid) FROM events").fetchone()[0] == 700
    _ship(db, store[1].url)
    assert _store_counts(store[0].url, node) == (before + 700, before + 700)


class AnswerLost(ClickHouse):
    """A client whose ``lose``-th insert reaches the server and commits, and whose answer is then lost
    (the shipper killed, the connection cut, after ClickHouse wrote the rows)."""

    def __init__(self, url: str, lose: int) -> None:
        super().__init__(url)
        self.inserts, self.lose = 0, lose

    def insert(
        self, table: str, columns: tuple[str, ...], tsv: bytes, settings: dict[str, str | int] | None = None
    ) -> None:  # type: ignore[override]
        super().insert(table, columns, tsv, settings)
        self.inserts += 1
        if self.inserts == self.lose:
            raise ClickHouseUnavailableError("connection lost after the insert")


def test_a_batch_whose_answer_was_lost_is_not_sent_twice(store: list[Server], tmp_path: Path) -> None:
    db = _copies(tmp_path)[2]
    node, events = _node(db), BY_NAME["events"]
    with (
        AnswerLost(store[0].url, lose=3) as ch,
        Shipper(db, ch, batch_rows=1000) as sh,
        pytest.raises(ClickHouseUnavailableError),
    ):
        sh.ship_table(events)
    assert _store_counts(store[1].url, node) == (3000, 3000)
    assert {r.table: r for r in lag(db)}["events"].unshipped_rows == _sqlite_counts(db)["events"] - 2000
    with ClickHouse(store[1].url) as ch, Shipper(db, ch, batch_rows=1000) as sh:
        prog = sh.ship_table(events)
    assert (prog.settled, prog.resent) == (1, 0)
    n = _sqlite_counts(db)["events"]
    assert prog.rows == n - 3000 and _store_counts(store[0].url, node) == (n, n)


def test_a_shipper_killed_mid_ship_resumes_without_loss_or_duplicates(store: list[Server], tmp_path: Path) -> None:
    db = _copies(tmp_path)[0]
    cmd = [sys.executable, "-m", "ingero", "ship", "--db", str(db), "--clickhouse", store[0].url, "--batch-rows", "25"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    shipped = 0
    while time.monotonic() < deadline and proc.poll() is None:
        conn = sqlite3.connect(db, timeout=5)
        try:
            row = (
                conn.execute("SELECT rows FROM clickhouse_progress WHERE tbl = 'events'").fetchone()
                if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'clickhouse_progress'").fetchone()
                else None
            )
        finally:
            conn.close()
        shipped = row[0] if row else 0
        if shipped >= 500:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    n = _sqlite_counts(db)["events"]
    node = _node(db)
    partial = _store_counts(store[1].url, node)
    assert partial[0] == partial[1] and 500 <= partial[0] < n
    _ship(db, store[1].url)  # resumed through the other server: the progress is the recording's
    assert _store_counts(store[0].url, node) == (n, n)
    assert _store_table_counts(store[0].url) == {(node, t): (c, c) for t, c in _sqlite_counts(db).items() if c}


def _more_events(db: Path, node: str, n: int) -> None:
    """Record ``n`` more events through the real writer (what a tracer does)."""
    from ingero.identity import Identity
    from ingero.store.catalog import op_id
    from ingero.store.writer import StoreWriter

    conn = sqlite3.connect(db)
    try:
        last = conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
    except sqlite3.OperationalError:  # a new recording
        last = None
    finally:
        conn.close()
    last = last or 1_800_000_000 * 10**9
    source, op = op_id("cudaMalloc")
    rows = [(last + (i + 1) * 1000, 4242, 4242, source, op, 5000, 0, 1 << 20, 0, 0, 0, 0) for i in range(n)]
    with StoreWriter(db, Identity(node)) as w:
        w.write_batch(rows)


def test_a_down_store_stalls_shipping_never_recording_and_it_resumes(store: list[Server], tmp_path: Path) -> None:
    entry = store[0]
    db = _copies(tmp_path)[1]
    node = _node(db)
    rounds: list[tuple[int | None, str | None]] = []

    def on_round(res: ShipResult | None, err: str | None) -> None:
        rounds.append((res.rows if res else None, err))

    stop = threading.Event()
    ch = ClickHouse(entry.url, timeout_s=5)
    sh = Shipper(db, ch)
    t = threading.Thread(
        target=sh.follow, args=(stop,), kwargs={"interval_s": 0.05, "max_backoff_s": 0.4, "on_round": on_round}
    )
    t.start()
    try:
        _wait(lambda: _store_counts(entry.url, node)[0] == _sqlite_counts(db)["events"], "first ship")
        entry.stop(kill=True)
        _more_events(db, node, 3000)  # the recording goes on while the store is down
        _wait(lambda: sum(1 for _, e in rounds if e) >= 2, "stalled rounds")
        behind = {r.table: r for r in lag(db)}["events"]
        assert behind.unshipped_rows == 3000 and behind.oldest_unshipped_ns is not None
        assert _metrics_lag(db, node) == (3000.0, True)  # the agent's /metrics says it too
        assert sh.last_error is not None and "ClickHouse" in sh.last_error
        entry.restart()
        n = _sqlite_counts(db)["events"]
        _wait(lambda: {r.table: r for r in lag(db)}["events"].unshipped_rows == 0, "resumed shipping")
    finally:
        stop.set()
        t.join(timeout=20)
        sh.close()
        ch.close()
    assert _store_counts(store[1].url, node) == (n, n)
    assert rounds[-1][1] is None
    assert _metrics_lag(db, node) == (0.0, False)


def _metrics_lag(db: Path, node: str) -> tuple[float, bool]:
    """The events row of ``ingero_clickhouse_unshipped_rows`` and whether its lag in seconds is positive,
    as the agent's /metrics provider (trace and serve) reports them."""
    from ingero.identity import Identity
    from ingero.metrics import registry as r
    from ingero.metrics.dbfeed import database_provider
    from ingero.metrics.state import MetricState

    samples = database_provider(MetricState(Identity(node), "serve"), db)()
    got = {(s.metric.name, s.labels[-1]): s.value for s in samples if s.metric in (r.SHIP_BEHIND, r.SHIP_LAG)}
    return got[("ingero_clickhouse_unshipped_rows", "events")], got[("ingero_clickhouse_lag_seconds", "events")] > 0


def _wait(cond: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():  # type: ignore[operator]
                return
        except (ClickHouseUnavailableError, httpx.HTTPError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def shipped(cluster: list[Server], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The three recordings, shipped once, for the read-only tests (which never change the store)."""
    _clear(cluster)
    for s in cluster:
        if s.proc is None:
            s.restart()
    dbs = _copies(tmp_path_factory.mktemp("shipped"))
    for db in dbs:
        _ship(db, cluster[0].url)
    return dbs


SEED = SEED_QUERY


def test_the_seed_query_runs_unchanged_through_clickhouse(
    cluster: list[Server], shipped: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = []
    for db in shipped:
        assert main(["query", "--db", str(db), "--json", SEED]) == 0
        expected += [tuple(r) for r in json.loads(capsys.readouterr().out)["rows"]]
    for s in cluster:
        assert main(["query", "--clickhouse", s.url, "--json", SEED]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["columns"] == ["node", "source", "cnt", "avg_us"]
        got = [tuple(r) for r in doc["rows"]]
        assert sorted((a, b, c) for a, b, c, _ in got) == sorted((a, b, c) for a, b, c, _ in expected)
        avg = {(a, b): d for a, b, _, d in expected}
        assert all(d == pytest.approx(avg[(a, b)], rel=1e-9) for a, b, _, d in got)
    assert main(["query", "--clickhouse", cluster[0].url, "--csv", "--limit", "2", SEED]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3  # header + the limit
    assert main(["query", "--clickhouse", cluster[0].url, "--json", "--limit", "5"]) == 0  # no statement: the latest
    latest = json.loads(capsys.readouterr().out)
    assert latest["truncated"] and len(latest["rows"]) == 5
    newest = max(sqlite3.connect(db).execute("SELECT max(timestamp) FROM events").fetchone()[0] for db in shipped)
    assert latest["rows"][0][latest["columns"].index("timestamp")] == newest


HOSTILE = [
    "INSERT INTO events_local (node) VALUES ('x')",
    "DROP TABLE events",
    "ALTER TABLE events_local DELETE WHERE 1",
    "SELECT * FROM system.processes",
    "SELECT name FROM system.users",
    "SELECT * FROM url('http://127.0.0.1:1/', TSV, 'a String')",
    "SELECT * FROM file('/etc/passwd', TSV, 'a String')",
    "SELECT * FROM remote('127.0.0.1', system.one)",
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT 1; DROP TABLE events",
    "SELECT 1 FORMAT TSV",
]


@pytest.mark.parametrize("sql", HOSTILE)
def test_hostile_statements_are_refused(
    cluster: list[Server], shipped: list[Path], sql: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["query", "--clickhouse", cluster[1].url, sql]) == 2
    assert "ingero: error:" in capsys.readouterr().err


def test_the_connection_itself_is_read_only(cluster: list[Server], shipped: list[Path]) -> None:
    """Past the statement check, the server refuses: readonly=1 travels with every request."""
    with ClickHouse(cluster[0].url, settings=READONLY_SETTINGS) as ch:
        for sql in (
            "INSERT INTO events_local (node) VALUES ('x')",
            "CREATE TABLE t (x Int64) ENGINE = Memory",
            "SELECT * FROM url('http://127.0.0.1:1/', TSV, 'a String')",
        ):
            with pytest.raises(QueryRejectedError):
                ch.execute(sql)
        assert ch.select("SELECT count() FROM events").rows[0][0] == sum(_sqlite_counts(db)["events"] for db in shipped)


def _explain_doc(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["explain", "--json", *argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    return doc


def test_explain_over_stored_rows_names_what_explain_on_the_recording_names(
    cluster: list[Server], shipped: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    for db in shipped:
        node = _node(db)
        local = _explain_doc(["--db", str(db), "--since", "1h"], capsys)
        stored = _explain_doc(["--clickhouse", cluster[1].url, "--node", node, "--since", "1h"], capsys)
        assert stored["events"] == local["events"] and stored["nodes"] == [node]
        assert stored["window"]["end_ns"] == local["window"]["end_ns"]  # type: ignore[index]
        for key in ("chains", "ops", "ledger", "host"):
            assert json.dumps(stored[key], sort_keys=True) == json.dumps(local[key], sort_keys=True), (node, key)
    assert main(["explain", "--clickhouse", cluster[0].url, "--node", "nope", "--since", "1h"]) == 2


def _serving_db(path: Path, node: str, regressed: bool) -> Path:
    """A serving node's recording: kernel launches and host events, and its vLLM engine's series (pid 7)
    over the 40 s before the last event; a regressed engine queues up with slower first tokens. Two
    hours earlier, pid 8 regressed the same way: outside a one-hour window."""
    waiting, ttft = (plateaus(2.0, 40.0), plateaus(0.1, 0.5)) if regressed else ([2.0] * SCRAPES, [0.1] * SCRAPES)
    series = series_db(path.with_suffix(".series.db"), [0.6] * SCRAPES, [0] * SCRAPES, waiting, ttft)
    old = series_db(
        path.with_suffix(".old.db"), [0.6] * SCRAPES, [0] * SCRAPES, plateaus(2.0, 40.0), plateaus(0.1, 0.5)
    )
    rows: list[EngineMetricRow] = []
    for src, shift, pid in ((series, 0, 7), (old, -2 * 3600 * S, 8)):
        conn = sqlite3.connect(src)
        try:
            got = conn.execute("SELECT ts, engine, metric, labels, value FROM engine_metrics").fetchall()
        finally:
            conn.close()
        rows += [(ts + shift, pid, engine, metric, labels, value) for ts, engine, metric, labels, value in got]
    events = straggler_events(200, 2.0, 1)
    to_end = T0 + SCRAPES * S - max(e[0] for e in events)  # the last event just after the last scrape
    write_db(path, [(e[0] + to_end, *e[1:]) for e in events], node=node)
    with StoreWriter(path, Identity(node)) as w:
        w.write_batch(engine_metrics=rows)
    return path


def _chains(doc: dict[str, object]) -> list[dict[str, Any]]:
    chains = doc["chains"]
    assert isinstance(chains, list)
    return chains


def _serving(doc: dict[str, object]) -> list[dict[str, Any]]:
    return [c for c in _chains(doc) if c["family"].startswith("serving/")]


def test_explain_over_stored_rows_draws_the_serving_chains(
    store: list[Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engines' series are stored rows too: explain through the store names the same serving chains
    as on the recording, of the node asked (not another node's engine) and of the window (not pid 8's
    regression two hours before); a store whose schema predates ``engine_metrics`` still explains."""
    dbs = {node: _serving_db(tmp_path / f"{node}.db", node, node == "serve-a") for node in ("serve-a", "serve-b")}
    for db in dbs.values():
        _ship(db, store[0].url)
    for node, db in dbs.items():
        for window in (["--since", "1h"], []):
            local = _explain_doc(["--db", str(db), *window], capsys)
            stored = _explain_doc(["--clickhouse", store[1].url, "--node", node, *window], capsys)
            assert json.dumps(stored["chains"], sort_keys=True) == json.dumps(local["chains"], sort_keys=True)
            got = [(c["node"], c["family"], c["severity"], c["summary"].split(")")[0]) for c in _serving(stored)]
            expect = [(node, "serving/queue", "HIGH", "vllm (pid 7")] if node == "serve-a" else []
            if not window:  # the whole recording: pid 8's regression too
                expect += [(node, "serving/queue", "HIGH", "vllm (pid 8")]
            assert sorted(got) == expect, (node, window)
    with ClickHouse(store[1].url) as ch:
        ch.execute("DROP TABLE engine_metrics")  # as a store set up before schema 5 (the other server keeps it)
    try:
        local = _explain_doc(["--db", str(dbs["serve-a"]), "--since", "1h"], capsys)
        stored = _explain_doc(["--clickhouse", store[1].url, "--node", "serve-a", "--since", "1h"], capsys)
        assert _serving(local) and not _serving(stored)
        assert [c for c in _chains(local) if c not in _serving(local)] == _chains(stored)
    finally:
        assert main(["clickhouse-schema", "--cluster", CLUSTER, "--apply", store[1].url]) == 0


def test_stragglers_from_the_store_name_the_late_rank(
    cluster: list[Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _clear(cluster)
    names = ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
    job = Job([Rank(n, extra_ms=60.0 if n == "gpu-node-02" else 0.0) for n in names], steps=200)
    for calls in simulate(job):
        _ship(write_calls_db(tmp_path / f"{calls.node}.db", calls), cluster[0].url)
    assert main(["fleet", "stragglers", "--clickhouse", cluster[1].url, "--since", "1d", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "straggler" and doc["outlier"] == "gpu-node-02" and doc["source"] == "collectives"
    ranks = {r["node"]: r for r in doc["ranks"]}
    assert set(ranks) == set(names) and all(r["calls"] == 200 for r in ranks.values())
    assert ranks["gpu-node-02"]["last"] == 200
    assert main(["fleet", "stragglers", "--clickhouse", cluster[1].url, "--since", "1d"]) == 0
    assert capsys.readouterr().out.count("straggler: gpu-node-02") == 1


def test_background_shipping_follows_a_recording_that_starts_later(store: list[Server], tmp_path: Path) -> None:
    """What ``ingero trace --clickhouse`` runs: a thread that waits for the database, then follows it."""
    from ingero.clickhouse.shipper import BackgroundShipping

    db = tmp_path / "live.db"
    errors: list[str] = []
    bg = BackgroundShipping(
        db, lambda: ClickHouse(store[1].url), interval_s=0.05, on_round=lambda r, e: errors.append(e) if e else None
    ).start()
    try:
        time.sleep(0.2)
        db.touch()  # what a starting tracer leaves for a moment: an empty file (never to be made ours)
        time.sleep(0.2)
        assert db.stat().st_size == 0
        node = "gpu-node-07"
        for _ in range(3):  # the tracer's writer creates its schema in that file, then records
            _more_events(db, node, 500)
            time.sleep(0.1)
        n = _sqlite_counts(db)["events"]
        _wait(lambda: _store_counts(store[0].url, node) == (n, n), "background shipping")
        # a session row the recorder updates in place (started, then stopped) is sent again when it changes
        from ingero.identity import Identity
        from ingero.store.writer import StoreWriter

        with StoreWriter(db, Identity(node)) as w:
            sid = w.start_session()
            _wait(lambda: _stored_sessions(store[1].url, node).get(sid) == 0, "the open session")
            w.end_session(sid)
        stopped = sqlite3.connect(db).execute("SELECT stopped_at FROM sessions WHERE id = ?", (sid,)).fetchone()[0]
        _wait(lambda: _stored_sessions(store[1].url, node).get(sid) == stopped, "the stopped session")
    finally:
        bg.stop()
    assert bg.error is None and not errors


def _stored_sessions(url: str, node: str) -> dict[int, int]:
    """id -> stopped_at of a node's sessions as readers see them (FINAL: the last version sent)."""
    with ClickHouse(url) as ch:
        return {
            int(i): int(s)
            for i, s in ch.select(f"SELECT id, stopped_at FROM sessions FINAL WHERE node = '{node}'").rows
        }


@pytest.mark.bpf
def test_trace_ships_while_it_records(store: list[Server], tmp_path: Path) -> None:
    """``ingero trace --clickhouse``: a real eBPF recording (host events of this machine) shipped from the
    tracer's own thread; when it stops, the store holds every event it recorded, under its node."""
    db = tmp_path / "trace.db"
    cmd = [sys.executable, "-m", "ingero", "trace", "--db", str(db), "--duration", "4s", "--quiet"]
    proc = subprocess.run(
        [*cmd, "--node", "traced-node", "--clickhouse", store[0].url], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    n = _sqlite_counts(db)["events"]
    assert n > 0 and _node(db) == "traced-node"
    assert _store_counts(store[1].url, "traced-node") == (n, n)
    assert _stored_sessions(store[1].url, "traced-node") == dict(
        sqlite3.connect(db).execute("SELECT id, stopped_at FROM sessions").fetchall()
    )
