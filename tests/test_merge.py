"""ingero merge: Ingero samples → the same cluster database Ingero built, old layouts, collisions, CLI."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.errors import InvalidNodeNameError, StoreError, UsageError
from ingero.identity import Identity
from ingero.store.annotations import add_annotation
from ingero.store.db import open_readonly, open_writable
from ingero.store.merge import merge_databases
from ingero.store.merge_inputs import inspect_input
from ingero.store.writer import StoreWriter
from tests.conftest import INVESTIGATIONS, SEED_QUERY, make_ingero_08, write_db

NODES = ("sample-gpu-node-01.db", "sample-gpu-node-02.db", "sample-gpu-node-03.db")
EVENT_COLS = (
    "id, timestamp, pid, tid, source, op, duration, gpu_id, arg0, arg1, ret_code, stack_hash, node, rank, "
    "local_rank, world_size, stack_ips, cgroup_id"
)


def _ev(i: int, t0: int = 1_775_218_723_000_000_000, step: int = 1_000_000) -> tuple[int, ...]:
    return (t0 + i * step, 100, 100, 1, 1, 1000 + i, 0, i, 0, 0, 0, 0)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _except(out: Path, ref: Path, table: str, cols: str = "*") -> int:
    conn = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
    conn.execute("ATTACH DATABASE ? AS ref", (f"file:{ref}?mode=ro&immutable=1",))
    n = conn.execute(
        f"SELECT count(*) FROM (SELECT {cols} FROM main.{table} EXCEPT SELECT {cols} FROM ref.{table})"
    ).fetchone()[0]
    conn.close()
    return int(n)


def test_samples_merge_like_ingero_cluster_db(tmp_path: Path, samples: Path) -> None:
    inputs = [samples / n for n in NODES]
    before = [_sha(p) for p in inputs]
    out = tmp_path / "cluster.db"
    report = merge_databases(inputs, out)
    assert [_sha(p) for p in inputs] == before  # inputs untouched
    assert (report.events, report.stacks, report.stacks_seen, report.sessions, report.chains) == (600, 9, 10, 3, 6)
    assert {n: (r.events, r.chains, r.sessions) for n, r in report.nodes.items()} == {
        "gpu-node-01": (200, 4, 1),
        "gpu-node-02": (200, 1, 1),
        "gpu-node-03": (200, 1, 1),
    }
    ref = samples / "sample-cluster.db"
    conn = open_readonly(out)
    assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 600
    assert conn.execute(SEED_QUERY).fetchall() == open_readonly(ref).execute(SEED_QUERY).fetchall()
    # row for row what Ingero's own merge produced
    assert _except(out, ref, "events", EVENT_COLS) == 0
    assert _except(out, ref, "stack_traces") == 0
    assert _except(out, ref, "causal_chains") == 0
    assert _except(out, ref, "sessions") == 0
    assert _except(out, ref, "process_names") == 0
    # a normal ingero database: our schema version, WAL, node_seq past each node's highest id
    assert conn.execute("PRAGMA user_version").fetchone()[0] >= 1
    assert dict(conn.execute("SELECT node, next_seq FROM node_seq")) == {
        "gpu-node-01": 3738,
        "gpu-node-02": 554,
        "gpu-node-03": 563,
    }
    # per-node tables without a node column: nothing lost
    assert conn.execute("SELECT count(*) FROM system_snapshots").fetchone()[0] == 5
    assert dict(conn.execute("SELECT node, count(*) FROM system_snapshots GROUP BY node")) == {
        "gpu-node-01": 1,
        "gpu-node-02": 2,
        "gpu-node-03": 2,
    }
    assert sorted(conn.execute("SELECT node, name FROM node_process_names WHERE pid = 96")) == [
        ("gpu-node-01", "jbd2/nvme1n1p1-8"),
        ("gpu-node-02", "jbd2/nvme0n1p1-8"),
    ]
    assert report.process_name_conflicts == 1
    assert json.loads(conn.execute("SELECT value FROM schema_info WHERE key = 'merge_inputs'").fetchone()[0])[1] == {
        "file": "sample-gpu-node-02.db",
        "layout": "ingero-0.9",
        "nodes": ["gpu-node-02"],
        "events": 200,
    }
    assert any("do not overlap" in w for w in report.warnings)  # recorded minutes apart
    assert not list(tmp_path.glob(".cluster.db.merging-*"))


def test_writer_appends_to_merged_database(tmp_path: Path, samples: Path) -> None:
    out = tmp_path / "cluster.db"
    merge_databases([samples / n for n in NODES], out)
    with StoreWriter(out, Identity("gpu-node-02")) as w:
        w.write_batch([_ev(0)])
    conn = open_readonly(out)
    assert conn.execute("SELECT count(*) FROM events WHERE id = 'gpu-node-02:554'").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) - count(DISTINCT id) FROM events").fetchone()[0] == 0


def test_refuses_to_overwrite_unless_forced(tmp_path: Path, samples: Path) -> None:
    out = tmp_path / "cluster.db"
    out.write_text("precious")
    with pytest.raises(UsageError, match="already exists"):
        merge_databases([samples / NODES[0]], out)
    assert out.read_text() == "precious"
    report = merge_databases([samples / NODES[0]], out, force=True)
    assert report.events == 200
    assert open_readonly(out).execute("SELECT count(*) FROM events").fetchone()[0] == 200
    with pytest.raises(UsageError, match="also an input"):
        merge_databases([out], out, force=True)


def test_failed_merge_leaves_no_output(tmp_path: Path, samples: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 100)
    out = tmp_path / "cluster.db"
    with pytest.raises(StoreError):
        merge_databases([samples / NODES[0], bad], out)
    assert list(tmp_path.iterdir()) == [bad]


def _make_ingero_08(path: Path, n: int = 4, t0: int = 1_775_218_723_000_000_000) -> None:
    stack = 3130596151848727151
    make_ingero_08(
        path,
        [(t0 + i * 1000, 7, 7, 4, 5, 2000 + i, 0, stack if i == 0 else 0) for i in range(n)],
        sessions=[(t0, t0 + n * 1000, "T4")],
        chains=[("tail-medium-cuMemAlloc", t0 + 500, "MEDIUM", "s", "r", "e")],
        stacks=[(stack, '["0x1"]', "")],
    )


def test_ingero_08_needs_force_node_and_gets_namespaced_ids(tmp_path: Path, samples: Path) -> None:
    old = tmp_path / "old.db"
    _make_ingero_08(old)
    out = tmp_path / "cluster.db"
    with pytest.raises(UsageError, match="--force-node"):
        merge_databases([old, samples / NODES[1]], out)
    with pytest.raises(InvalidNodeNameError):
        merge_databases([old], out, force_node=["bad name!"])
    report = merge_databases([old, samples / NODES[1]], out, force_node=["gpu-node-07"])
    assert report.events == 204
    conn = open_readonly(out)
    rows = conn.execute("SELECT id, node, rank FROM events WHERE node = 'gpu-node-07' ORDER BY timestamp").fetchall()
    assert rows == [(f"gpu-node-07:{i}", "gpu-node-07", None) for i in range(1, 5)]
    assert conn.execute("SELECT node, gpu_model FROM sessions WHERE node = 'gpu-node-07'").fetchall() == [
        ("gpu-node-07", "T4")
    ]
    assert conn.execute("SELECT id, node, cuda_op FROM causal_chains WHERE node = 'gpu-node-07'").fetchall() == [
        ("gpu-node-07:tail-medium-cuMemAlloc", "gpu-node-07", "")
    ]
    # the same stack hash as node 02's: one row, and node 02's resolved frames win over the empty ones
    frames = conn.execute("SELECT frames FROM stack_traces WHERE hash = 3130596151848727151").fetchone()[0]
    assert frames.startswith("[{")
    assert conn.execute("SELECT next_seq FROM node_seq WHERE node = 'gpu-node-07'").fetchone()[0] == 5
    # per-file form names one input only
    out2 = tmp_path / "c2.db"
    merge_databases([old, samples / NODES[1]], out2, force_node=[f"{old}=gpu-node-08"])
    assert open_readonly(out2).execute("SELECT DISTINCT node FROM events ORDER BY node").fetchall() == [
        ("gpu-node-02",),
        ("gpu-node-08",),
    ]


def test_rows_without_node_take_the_forced_name(tmp_path: Path) -> None:
    db = write_db(tmp_path / "anon.db", [_ev(i) for i in range(3)], node="tmp")
    conn = sqlite3.connect(db)
    conn.execute("UPDATE events SET node = '', id = substr(id, 4)")  # "tmp:1" -> ":1"
    conn.execute("UPDATE sessions SET node = ''")
    conn.commit()
    conn.close()
    report = merge_databases([db], tmp_path / "a.db")
    assert any("no node name" in w for w in report.warnings)
    merge_databases([db], tmp_path / "b.db", force_node=["gpu-node-04"])
    got = open_readonly(tmp_path / "b.db").execute("SELECT id, node FROM events ORDER BY timestamp").fetchall()
    assert got == [(f"gpu-node-04:{i}", "gpu-node-04") for i in (1, 2, 3)]


def test_same_node_twice_is_refused_unless_dedupe(tmp_path: Path, samples: Path) -> None:
    inputs = [samples / "sample-cluster.db", samples / NODES[1]]
    with pytest.raises(StoreError, match="gpu-node-02.*--dedupe"):
        merge_databases(inputs, tmp_path / "c.db")
    assert not (tmp_path / "c.db").exists()
    report = merge_databases(inputs, tmp_path / "c.db", dedupe=True)
    assert (report.events, report.duplicates_skipped, report.sessions, report.snapshots) == (600, 200, 3, 5)
    assert report.nodes["gpu-node-02"].events == 200
    conn = open_readonly(tmp_path / "c.db")
    assert conn.execute("SELECT count(*) - count(DISTINCT id) FROM events").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM system_snapshots WHERE node = ''").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'merge_tmp_event_ids'").fetchone()[0] == 0


def test_same_node_with_disjoint_ids_merges(tmp_path: Path) -> None:
    a = write_db(tmp_path / "a.db", [_ev(i) for i in range(5)], node="n1")
    b = tmp_path / "b.db"
    conn = open_writable(b)
    conn.execute("INSERT INTO node_seq(node, next_seq) VALUES ('n1', 6)")  # a rotated database
    conn.close()
    write_db(b, [_ev(i) for i in range(5, 9)], node="n1")
    report = merge_databases([a, b], tmp_path / "out.db")
    assert report.events == 9
    assert report.nodes["n1"].events == 9
    conn = open_readonly(tmp_path / "out.db")
    assert conn.execute("SELECT count(DISTINCT id), max(CAST(substr(id, 4) AS INTEGER)) FROM events").fetchone() == (
        9,
        9,
    )
    assert conn.execute("SELECT next_seq FROM node_seq WHERE node = 'n1'").fetchone()[0] == 10
    assert conn.execute("SELECT count(*) FROM sessions").fetchone()[0] == 2


def test_skew_warning_names_shifted_node(tmp_path: Path) -> None:
    t0 = 1_775_218_723_000_000_000
    a = write_db(tmp_path / "a.db", [_ev(i, t0) for i in range(100)], node="gpu-a")
    b = write_db(tmp_path / "b.db", [_ev(i, t0 + 20_000_000) for i in range(100)], node="gpu-b")
    c = write_db(tmp_path / "c.db", [_ev(i, t0 + 30_000_000) for i in range(100)], node="gpu-c")
    # 100 events 1 ms apart: ranges of 99 ms; gpu-b/gpu-c shifted 20/30 ms
    assert merge_databases([a, b, c], tmp_path / "ok.db", skew_threshold_ns=50_000_000).warnings == []
    warnings = merge_databases([a, b, c], tmp_path / "skew.db", skew_threshold_ns=5_000_000).warnings
    assert len(warnings) == 2
    assert "gpu-a" in warnings[0] and "behind" in warnings[0]
    assert "gpu-c" in warnings[1] and "ahead of" in warnings[1]


def test_live_input_is_read_consistently(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    w = StoreWriter(db, Identity("gpu-live"), checkpoint_interval_s=3600)
    try:
        w.write_batch([_ev(i) for i in range(50)])
        assert Path(str(db) + "-wal").exists()
        info = inspect_input(db, None)
        assert info.live
        report = merge_databases([db], tmp_path / "out.db")
        assert report.events == 50
    finally:
        w.close()


def test_cli_merge_json_and_errors(tmp_path: Path, samples: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.db"
    args = ["merge", *(str(samples / n) for n in NODES), "-o", str(out)]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["events"] == 600 and doc["stacks"] == 9
    assert [(n["node"], n["events"]) for n in doc["nodes"]] == [
        ("gpu-node-01", 200),
        ("gpu-node-02", 200),
        ("gpu-node-03", 200),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert main([*args, "--force"]) == 0
    captured = capsys.readouterr()
    assert "gpu-node-03" in captured.out and "merged 3 database(s)" in captured.err
    assert "warning: recordings do not overlap" in captured.err
    assert main(["merge", str(tmp_path / "missing.db"), "-o", str(tmp_path / "x.db")]) == 1
    assert "no such database" in capsys.readouterr().err


@pytest.mark.skipif(
    not (INVESTIGATIONS / "sample-cluster.db").exists(), reason="investigations/ not generated (make investigations)"
)
def test_investigations_merge_like_their_cluster_db(tmp_path: Path) -> None:
    inputs = [INVESTIGATIONS / n for n in NODES]
    report = merge_databases(inputs, tmp_path / "cluster.db")
    ref = INVESTIGATIONS / "sample-cluster.db"
    assert report.events == open_readonly(ref).execute("SELECT count(*) FROM events").fetchone()[0]
    assert report.warnings == []  # the three nodes recorded the same 90 s: no skew suspected
    assert _except(tmp_path / "cluster.db", ref, "events", EVENT_COLS) == 0
    assert _except(tmp_path / "cluster.db", ref, "causal_chains") == 0
    assert {n: r.events for n, r in report.nodes.items()} == dict(
        open_readonly(ref).execute("SELECT node, count(*) FROM events GROUP BY node").fetchall()
    )


def test_collectives_and_annotations_survive_a_merge(tmp_path: Path) -> None:
    """nccl_calls, nccl_comms (with the cluster-wide comm_id) and annotations of every input reach the merged database."""
    inputs = []
    for rank, node in enumerate(("rank-a", "rank-b")):
        path = tmp_path / f"{node}.db"
        with StoreWriter(path, Identity(node)) as w:
            w.write_batch(
                [_ev(0)],
                nccl_comms=[(0xC0 + rank, 7, rank, 2, 1, 0x5EED)],
                nccl_calls=[(7, 7, 0xC0 + rank, k, 1, 1_000 + k, 50 + rank, 7, 0, 4, 16, -1, 0) for k in range(3)],
            )
        add_annotation(path, f"deploy on {node}", node=node, timestamp=2_000 + rank)
        inputs.append(path)
    out = tmp_path / "cluster.db"
    merge_databases(inputs, out)
    conn = sqlite3.connect(out)
    try:
        comms = conn.execute("SELECT node, rank, comm_id FROM nccl_comms ORDER BY node").fetchall()
        calls = conn.execute("SELECT node, count(*), sum(duration) FROM nccl_calls GROUP BY node ORDER BY node")
        assert comms == [("rank-a", 0, 0x5EED), ("rank-b", 1, 0x5EED)]
        assert calls.fetchall() == [("rank-a", 3, 150), ("rank-b", 3, 153)]
        notes = conn.execute("SELECT node, labels ->> 'message' FROM annotations ORDER BY timestamp").fetchall()
        assert notes == [("rank-a", "deploy on rank-a"), ("rank-b", "deploy on rank-b")]
    finally:
        conn.close()
