"""``ingero explain`` on local databases: output, windows, stored chains, and one-line errors."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ingero.cli.main import main
from ingero.demo.runner import run_scenario
from ingero.explain.engine import explain
from ingero.explain.frame_load import load_frames
from ingero.explain.stats import op_stats
from ingero.store.db import open_readonly
from tests.conftest import ROOT, make_ingero_08


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_scenario("incident", tmp_path_factory.mktemp("demo") / "incident.db").db


def test_text_report(capsys: pytest.CaptureFixture[str], incident: Path) -> None:
    code, out, _ = cli(capsys, "explain", "--db", str(incident))
    assert code == 0
    header = next(line for line in out.splitlines() if line.strip().startswith("op "))
    assert header.split() == ["op", "source", "count", "p50", "p95", "p99", "max", "p99/p50"]
    assert "causal chains (1)" in out and "[HIGH]" in out
    for part in ("root cause: CPU contention", "timeline:", "SYSTEM", "sched_switch", "fix:", "1. Pin"):
        assert part in out


def test_json_report(capsys: pytest.CaptureFixture[str], incident: Path) -> None:
    code, out, _ = cli(capsys, "explain", "--db", str(incident), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["nodes"] == ["demo-node"] and doc["stored_chains"] == 1
    assert doc["chains"][0]["severity"] == "HIGH" and doc["chains"][0]["origin"] == "computed"
    sync = next(o for o in doc["ops"] if o["op"] == "cudaStreamSync")
    assert sync["node"] == "demo-node" and sync["p99_us"] > 6 * sync["p50_us"]
    assert doc["host"]["sched_switch"] == doc["hosts"]["demo-node"]["sched_switch"] > 500


def test_op_filter_and_per_process(capsys: pytest.CaptureFixture[str], incident: Path) -> None:
    code, out, _ = cli(capsys, "explain", "--db", str(incident), "--op", "cudaStreamSynchronize", "--json")
    doc = json.loads(out)
    assert code == 0 and [o["op"] for o in doc["ops"]] == ["cudaStreamSync"] and len(doc["chains"]) == 1
    code, out, _ = cli(capsys, "explain", "--db", str(incident), "--op", "cuMemAlloc", "--json")
    doc = json.loads(out)
    assert doc["ops"] == [] and doc["chains"] == [] and "no cuMemAlloc events in the window" in doc["notes"]
    code, out, _ = cli(capsys, "explain", "--db", str(incident), "--per-process", "--json")
    assert json.loads(out)["chains"][0]["id"] == "demo-node:tail-cpu-cudaStreamSync-pid4242"


def test_since_on_a_finished_recording_counts_back_from_its_end(
    capsys: pytest.CaptureFixture[str], incident: Path
) -> None:
    code, out, err = cli(capsys, "explain", "--db", str(incident), "--since", "5s")
    assert code == 0 and "not a live recording: --since 5s counts back 5s from its last event" in err
    assert "no causal chains" in out  # the storm ended ten seconds before the end
    code, out, _ = cli(capsys, "explain", "--db", str(incident), "--since", "25s", "--json")
    doc = json.loads(out)
    assert doc["window"]["note"].startswith("not a live recording") and doc["chains"][0]["severity"] == "HIGH"


def test_ingero_samples_computed_and_stored(capsys: pytest.CaptureFixture[str], samples: Path) -> None:
    db = str(samples / "sample-cluster.db")
    code, out, err = cli(capsys, "explain", "--db", db)
    assert code == 0 and "gpu-node-01" in out and "cuMemAlloc" in out
    assert "no causal chains" in out and "stores 6 chain(s)" in out and "--chains" in out
    assert "gpu-node-01: no CUDA/driver/NCCL events in the window" in err
    code, out, _ = cli(capsys, "explain", "--db", db, "--chains", "--json")
    chains = json.loads(out)["chains"]
    assert code == 0 and len(chains) == 6 and {c["origin"] for c in chains} == {"stored"}
    assert [c["severity"] for c in chains] == ["HIGH", "HIGH", "MEDIUM", "MEDIUM", "MEDIUM", "MEDIUM"]
    code, out, _ = cli(capsys, "explain", "--db", db, "--chains", "--node", "gpu-node-03")
    assert code == 0 and "1 stored causal chain(s)" in out and "137.2x" in out
    for name in ("sample-gpu-node-01.db", "sample-gpu-node-02.db"):
        code, out, _ = cli(capsys, "explain", "--db", str(samples / name), "--json")
        assert code == 0 and json.loads(out)["events"] == 200


def test_legacy_ingero_08_database(tmp_path: Path) -> None:
    db = make_ingero_08(
        tmp_path / "old-node.db", [(10**18 + i * 10**7, 7, 7, 1, 5, 1000 + i, int(i == 3), 0) for i in range(50)]
    )
    report = explain(open_readonly(db))
    assert report.nodes == ["old-node"] and report.ops[0].count == 50 and report.ops[0].errors == 1


def test_frames_split_nodes_and_find_nodes_without_sessions(tmp_path: Path) -> None:
    from ingero.explain import frame_load

    db = tmp_path / "m.db"
    from ingero.identity import Identity
    from ingero.store.writer import StoreWriter

    for node, dur in (("a", 1000), ("b", 2000), ("c", 3000)):
        with StoreWriter(db, Identity(node)) as w:
            if node != "c":  # node c wrote events but no session
                w.end_session(w.start_session({}, started_at=1), stopped_at=2)
            w.write_batch([(10**18 + i, 1, 1, 1, 5, dur, 0, 0, 0, 0, 0, 0) for i in range(300)])
    conn = open_readonly(db)
    frames = load_frames(conn)
    assert list(frames) == ["a", "b", "c"]
    assert {n: set(f.dur.tolist()) for n, f in frames.items()} == {"a": {1000}, "b": {2000}, "c": {3000}}
    old = frame_load.CHUNK_ROWS
    frame_load.CHUNK_ROWS = 100  # several group_concat slices
    try:
        again = load_frames(conn)
    finally:
        frame_load.CHUNK_ROWS = old
    assert {n: f.size for n, f in again.items()} == {"a": 300, "b": 300, "c": 300}
    assert [s.p50_ns for s in op_stats(conn, node="b")] == [2000.0]
    assert op_stats(conn)[0].count == 900  # without node: pooled, as before


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("explain", "demo", "investigations"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        out, _ = capsys.readouterr()
        assert e.value.code == 0 and "examples:" in out and f"ingero {cmd}" in out


@pytest.fixture
def not_sqlite(tmp_path: Path) -> Path:
    p = tmp_path / "notes.db"
    p.write_text("this is not a database\n" * 100)
    return p


@pytest.fixture
def no_events(tmp_path: Path) -> Path:
    p = tmp_path / "other.db"
    with sqlite3.connect(p) as conn:
        conn.execute("CREATE TABLE t (x)")
    return p


@pytest.fixture
def truncated(tmp_path: Path, incident: Path) -> Path:
    p = tmp_path / "cut.db"
    p.write_bytes(incident.read_bytes()[: 40 * 4096])
    return p


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["--db", "/nonexistent/trace.db"], "no such database file", 1),
        (["--db", "{not_sqlite}"], "is not a SQLite database", 1),
        (["--db", "{no_events}"], "has no 'events' table", 1),
        (["--db", "{truncated}"], "malformed", 1),
        (["--db", "{incident}", "--op", "cudaFrobnicate"], "unknown op 'cudaFrobnicate'", 2),
        (["--db", "{incident}", "--since", "yesterday"], "cannot parse duration 'yesterday'", 2),
        (["--db", "{incident}", "--from", "noon"], "cannot parse time 'noon'", 2),
        (["--db", "{incident}", "--node", "gpu-node-99"], "no node 'gpu-node-99'", 2),
        (["--db", "{incident}", "--pid", "-3"], "must be a process id", 2),
    ],
)
def test_bad_input_is_one_line_error(
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
    args: list[str],
    needle: str,
    code: int,
) -> None:
    argv = ["explain"]
    for a in args:
        if a.startswith("{"):
            a = str(request.getfixturevalue(a.strip("{}")))
        argv.append(a)
    rc, out, err = cli(capsys, *argv)
    assert rc == code and out == ""
    assert err.count("\n") == 1 and err.startswith("ingero: error: ") and needle in err, err


def test_no_traceback_from_the_real_command(not_sqlite: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ingero", "explain", "--db", str(not_sqlite)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("ingero: error:") and "Traceback" not in proc.stderr


def _same_frames(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name, fa in a.items():
        for col in ("source", "op", "dur", "failed", "ts_ns", "pid", "tid"):
            assert np.array_equal(getattr(fa, col), getattr(b[name], col)), (name, col)
        for col in ("source", "op", "pid", "ts_ns", "arg0", "arg1", "tid", "dur"):
            assert np.array_equal(getattr(fa.args, col), getattr(b[name].args, col)), (name, "args", col)


@pytest.mark.parametrize("chunk", [2_000_000, 700])  # one rowid range per thread; many, round-robin
def test_threaded_read_gives_the_same_frames_and_report(
    incident: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    from ingero.explain import frame_load

    conn = open_readonly(incident)
    serial, report = load_frames(conn), explain(conn)
    monkeypatch.setattr(frame_load, "PARALLEL_MIN_ROWS", 0)  # the demo database is small: split it anyway
    monkeypatch.setattr(frame_load, "CHUNK_ROWS", chunk)
    assert len(frame_load._rowid_slices(conn, 3)) >= 3
    _same_frames(serial, load_frames(conn, threads=3))
    again = explain(conn, threads=3)
    assert [(c.id, c.severity, c.summary) for c in again.chains] == [
        (c.id, c.severity, c.summary) for c in report.chains
    ]
    assert [o.as_dict() for o in again.ops] == [o.as_dict() for o in report.ops]


def test_a_time_window_or_a_node_is_read_by_one_query(incident: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ingero.explain import frame_load
    from ingero.store.window import Window

    conn = open_readonly(incident)
    monkeypatch.setattr(frame_load, "PARALLEL_MIN_ROWS", 0)
    hi = conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
    late = Window(hi - 2 * 10**9, None)  # found through the timestamp index: no rowid ranges
    node = conn.execute("SELECT node FROM events LIMIT 1").fetchone()[0]
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    for window, name in ((late, None), (None, node)):
        seen.clear()
        _same_frames(load_frames(conn, window, node=name), load_frames(conn, window, node=name, threads=3))
        assert not [q for q in seen if "rowid BETWEEN" in q]
    seen.clear()
    load_frames(conn, threads=3)  # the whole table: split
    assert [q for q in seen if "rowid BETWEEN" in q]


def test_threaded_read_of_an_ingero_08_database_keeps_one_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ingero.explain import frame_load

    db = make_ingero_08(tmp_path / "old.db", [(10**18 + i * 10**7, 7, 7, 1, 5, 1000 + i, 0, 0) for i in range(50)])
    conn = open_readonly(db)  # events is a TEMP view here (no rowid): read by one query
    monkeypatch.setattr(frame_load, "PARALLEL_MIN_ROWS", 0)
    assert frame_load._rowid_slices(conn, 2) == []
    _same_frames(load_frames(conn), load_frames(conn, threads=2))
