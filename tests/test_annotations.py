"""``ingero annotate`` marks reach explain (text and JSON) and the Perfetto timeline."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.identity import Identity
from ingero.store.annotations import add_annotation, list_annotations
from ingero.store.writer import EventRow, StoreWriter

S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "marks.db"
    with StoreWriter(path, Identity("node-a")) as w:
        # cudaMalloc calls of pid 7, one per 10 ms for a second
        w.write_batch([(T0 + i * 10_000_000, 7, 7, 1, 1, 20_000, 0, 4096, 0, 0, 0, 0) for i in range(100)])
        add_annotation(path, "deploy v2.3", node="node-a", timestamp=T0 + S // 2, author="ops@a")
        add_annotation(path, "before the window", node="node-a", timestamp=T0 - 3600 * S, author="ops@a")
    return path


def test_explain_lists_the_annotations_of_its_window(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frm, to = str(T0 // S), str((T0 + 2 * S) // S)
    assert main(["explain", "--db", str(db), "--from", frm, "--to", to, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(a["message"], a["timestamp"], a["author"]) for a in doc["annotations"]] == [
        ("deploy v2.3", T0 + S // 2, "ops@a")
    ]
    assert main(["explain", "--db", str(db), "--from", frm, "--to", to]) == 0
    text = capsys.readouterr().out
    assert "annotations (ingero annotate):" in text and "deploy v2.3" in text
    assert "before the window" not in text


def test_export_shows_annotations_on_the_timeline(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["export", "--db", str(db), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    marks = [e for e in events if e.get("cat") == "annotation"]
    assert sorted(m["name"] for m in marks) == ["annotation: before the window", "annotation: deploy v2.3"]
    deploy = next(m for m in marks if m["args"]["message"] == "deploy v2.3")
    first_launch = min(e["ts"] for e in events if e.get("ph") == "X")
    assert deploy["ph"] == "i" and deploy["s"] == "p"
    assert deploy["ts"] - first_launch == pytest.approx(500_000, abs=1)  # 0.5 s after the first call, in µs


def test_ingero_written_annotations_read_and_their_sql_runs(tmp_path: Path) -> None:
    """The table has Ingero's layout: its INSERT and SELECT run here, and its label rows read as text."""
    db = tmp_path / "mixed.db"
    add_annotation(db, "deploy v2.3", node="n1", timestamp=1_000, author="ops@host")
    conn = sqlite3.connect(db)
    try:
        conn.execute(  # Ingero's RecordAnnotation statement
            "INSERT INTO annotations (timestamp, labels, pid, start_time, span_start, span_end, "
            "peer_uid, peer_gid, peer_pid) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (2_000, '{"epoch":"3","step":"1200"}', 42, 7, 0, 0, 1000, 1000, 99),
        )
        conn.commit()
        marks = list_annotations(conn)
        assert [(m.timestamp, m.node, m.message, m.author) for m in marks] == [
            (1_000, "n1", "deploy v2.3", "ops@host"),
            (2_000, "", "epoch=3, step=1200", "uid 1000"),
        ]
        ingero_query = conn.execute(  # Ingero's QueryAnnotations
            "SELECT timestamp, labels, pid, start_time, span_start, span_end, peer_uid, peer_gid, peer_pid "
            "FROM annotations WHERE 1=1 AND timestamp >= ? ORDER BY timestamp DESC LIMIT ?",
            (0, 10),
        ).fetchall()
        assert [r[0] for r in ingero_query] == [2_000, 1_000]
    finally:
        conn.close()


# --- labels (Ingero's protocol): the writer's batch, the join, query/explain/merge/export -----------

HOST = 3
FORK, EXEC, EXIT = 7, 5, 6
MALLOC = (1, 1)


def ev(ts: int, pid: int, source: int = 1, op: int = 1, arg1: int = 0) -> EventRow:
    return (ts, pid, pid, source, op, 20_000, 0, 4096, arg1, 0, 0, 0)


def label_row(ts: int, labels: dict[str, str], pid: int = 0, span: tuple[int, int] = (0, 0)) -> tuple[int | str, ...]:
    return (ts, json.dumps(labels), pid, 0, span[0], span[1], 1000, 1000, 4242)


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    """pid 50 runs twice (fork at 0 s, exit at 5 s; fork again at 6 s, the same pid reused); pid 60
    forks at 0 s. Labels: node-wide run_id at 0.1 s; step=1 then step=2 instants for pid 50's first
    run; a span step=9 over [2 s, 3 s] for pid 60; phase=eval for pid 50 at 4 s."""
    path = tmp_path / "labelled.db"
    with StoreWriter(path, Identity("node-a")) as w:
        w.write_batch(
            [
                ev(T0, 1, HOST, FORK, arg1=50),
                ev(T0, 1, HOST, FORK, arg1=60),
                ev(T0 + 5 * S, 50, HOST, EXIT),
                ev(T0 + 6 * S, 1, HOST, FORK, arg1=50),
                *[ev(T0 + k * S + S // 2, 50) for k in range(8)],  # pid 50: 0.5 s ... 7.5 s
                *[ev(T0 + k * S + S // 2, 60) for k in range(8)],
            ],
            annotations=[
                label_row(T0 + S // 10, {"run_id": "r1"}),
                label_row(T0 + S, {"step": "1"}, pid=50),
                label_row(T0 + 2 * S, {"step": "2"}, pid=50),
                label_row(T0 + 2 * S, {"step": "9"}, pid=60, span=(T0 + 2 * S, T0 + 3 * S)),
                label_row(T0 + 4 * S, {"phase": "eval"}, pid=50),
            ],
        )
    return path


def test_the_writer_batch_carries_label_rows_with_its_node(labelled: Path) -> None:
    conn = sqlite3.connect(labelled)
    try:
        rows = conn.execute(
            "SELECT labels, pid, span_start, peer_uid, peer_pid, node FROM annotations ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    assert len(rows) == 5 and {r[5] for r in rows} == {"node-a"} and rows[0][3:5] == (1000, 4242)


def test_query_annotations_gives_each_event_the_labels_in_force(
    labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sql = "SELECT timestamp, pid FROM events WHERE source = 1 ORDER BY pid, timestamp"
    assert main(["query", "--db", str(labelled), "--annotations", "--json", sql]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"] if isinstance(doc, dict) else doc
    got = {
        (
            r["pid"] if isinstance(r, dict) else r[1],
            ((r["timestamp"] if isinstance(r, dict) else r[0]) - T0) // (S // 2),
        ): (r["labels"] if isinstance(r, dict) else r[2])
        for r in rows
    }
    # pid 50, first run: step 1 from 1 s, step 2 from 2 s, phase=eval from 4 s; the run_id everywhere
    assert got[(50, 1)] == "run_id=r1"
    assert got[(50, 3)] == "run_id=r1 step=1"
    assert got[(50, 5)] == "run_id=r1 step=2"
    assert got[(50, 9)] == "phase=eval run_id=r1 step=2"
    # pid 50 again after its exit (a reused pid): none of the first run's labels
    assert got[(50, 13)] == got[(50, 15)] == "run_id=r1"
    # pid 60: the span only inside [2 s, 3 s]; pid 50's labels never
    assert got[(60, 5)] == "run_id=r1 step=9"
    assert got[(60, 3)] == got[(60, 7)] == "run_id=r1"


def test_query_annotations_needs_timestamp_and_pid(labelled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "--db", str(labelled), "--annotations", "SELECT count(*) AS n FROM events"]) == 2
    assert "no timestamp or pid column" in capsys.readouterr().err


def test_the_latest_instant_wins_and_spans_end(tmp_path: Path) -> None:
    from ingero.store.annotation_join import EventKey, labels_in_force

    path = tmp_path / "steps.db"
    with StoreWriter(path, Identity("n")) as w:
        w.write_batch(
            [ev(T0, 7)],
            annotations=[
                label_row(T0 + 200, {"step": "2"}),
                label_row(T0 + 100, {"step": "1"}),  # written later, earlier instant: loses to step 2
                label_row(T0 + 400, {"step": "3"}, span=(T0 + 400, T0 + 500)),
            ],
        )
    conn = sqlite3.connect(path)
    try:
        got = labels_in_force(conn, [EventKey(T0 + t, 7) for t in (50, 150, 300, 450, 600)])
    finally:
        conn.close()
    assert [g.get("step") for g in got] == [None, "1", "2", "3", "2"]


def test_explain_annotations_summarises_the_labels(labelled: Path) -> None:
    from ingero.store.annotation_join import label_summary, render_label_summary

    conn = sqlite3.connect(labelled)
    try:
        summary = label_summary(conn, T0, T0 + 10 * S)
    finally:
        conn.close()
    assert summary["annotations"] == 5 and summary["spans"] == 1 and summary["pids"] == [50, 60]
    assert summary["keys"]["step"] == {"distinct": 3, "first": "1", "last": "9"}
    text = render_label_summary(summary)
    assert "step: 3 value(s), 1 ... 9" in text and "run_id: 1 value(s), r1" in text


def test_explain_annotations_flag(labelled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frm, to = str(T0 // S), str((T0 + 10 * S) // S)
    assert main(["explain", "--db", str(labelled), "--from", frm, "--to", to, "--annotations", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"]["keys"]["phase"]["last"] == "eval"
    assert main(["explain", "--db", str(labelled), "--from", frm, "--to", to, "--annotations"]) == 0
    assert "labels (ingero annotate, 5 annotation(s), 1 span(s), pids 50, 60):" in capsys.readouterr().out


def test_merge_carries_labels_and_export_draws_spans(labelled: Path, tmp_path: Path) -> None:
    other = tmp_path / "b.db"
    with StoreWriter(other, Identity("node-b")) as w:
        w.write_batch(
            [ev(T0 + S, 70)], annotations=[label_row(T0 + S, {"step": "5"}, pid=70, span=(T0 + S, T0 + 2 * S))]
        )
    merged = tmp_path / "cluster.db"
    assert main(["merge", str(labelled), str(other), "-o", str(merged)]) == 0
    conn = sqlite3.connect(merged)
    try:
        nodes = sorted(conn.execute("SELECT node, count(*) FROM annotations GROUP BY node").fetchall())
    finally:
        conn.close()
    assert nodes == [("node-a", 5), ("node-b", 1)]
    out = tmp_path / "cluster.json"
    assert main(["export", "--db", str(merged), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    spans = sorted((e["name"], e["dur"]) for e in events if e.get("cat") == "annotation" and e["ph"] == "X")
    assert spans == [("step=5", 1_000_000), ("step=9", 1_000_000)]  # µs
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M" and "labels" in str(e["args"].get("name", ""))}
    assert lanes == {"labels step (pid 60)", "labels step (pid 70)"}


def test_annotate_cli_writes_protocol_lines_directly_with_db(
    labelled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "marks.ndjson"
    src.write_text('{"labels": {"epoch": "3"}, "ts": 5}\n\n{"labels": {"step": "1"}, "span_start": 1, "span_end": 2}\n')
    assert main(["annotate", "--db", str(labelled), "--from-file", str(src)]) == 0
    assert main(["annotate", "--db", str(labelled), "--label", "phase=warmup", "--pid", str(os.getpid())]) == 0
    capsys.readouterr()
    assert main(["annotate", "--db", str(labelled), "--list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["labels"], r.get("pid")) for r in rows[:2]] == [
        ({"step": "1"}, None),
        ({"epoch": "3"}, None),
    ]  # by instant
    assert rows[-1]["labels"] == {"phase": "warmup"} and rows[-1]["pid"] == os.getpid()
    src.write_text('{"labels": {"ok": "1"}}\n{"labels": {"bad key": "1"}}\n')
    assert main(["annotate", "--db", str(labelled), "--from-file", str(src)]) == 2
    assert "line 2: label key" in capsys.readouterr().err


def test_annotate_cli_sends_to_the_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_annotate_socket import serve_and

    def client(path: Path) -> int:
        return main(["annotate", "--socket", str(path), "--label", "step=4", "--pid", "1"])

    code, rows, _ = serve_and(tmp_path, client)
    assert code == 0 and len(rows) == 1 and rows[0][2] == 1 and rows[0][8] == os.getpid()
    assert "sent 1 annotation(s) to" in capsys.readouterr().out


def test_annotate_cli_without_a_tracer_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["annotate", "--socket", str(tmp_path / "none.sock"), "--label", "step=1"]) == 1
    assert "no tracer is listening for annotations" in capsys.readouterr().err


def test_annotate_help_warns_that_labels_leak_through_cmdline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["annotate", "--help"])
    assert "/proc/<pid>/cmdline" in capsys.readouterr().out


def test_query_annotations_across_the_fleet(labelled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real mTLS agents: each node's events get that node's labels only (pid 50 is on both)."""
    from tests.fleet_agents import AgentSpec, agents_in_thread, make_pki

    other = tmp_path / "b.db"
    with StoreWriter(other, Identity("node-b")) as w:
        w.write_batch(
            [ev(T0, 1, HOST, FORK, arg1=50), ev(T0 + S, 50)], annotations=[label_row(T0, {"step": "77"}, pid=50)]
        )
    pki = make_pki(tmp_path / "pki")
    tls = ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
    with agents_in_thread(pki, [AgentSpec(labelled, "node-a"), AgentSpec(other, "node-b")]) as servers:
        nodes = ",".join(f"{s.host}:{s.port}" for s in servers)
        sql = f"SELECT timestamp, pid FROM events WHERE source = 1 AND pid = 50 AND timestamp < {T0 + 2 * S}"
        assert main(["query", "--nodes", nodes, *tls, "--annotations", "--json", sql]) == 0
    doc = json.loads(capsys.readouterr().out)
    cols = doc["columns"]
    got = sorted((r[cols.index("node")], r[cols.index("timestamp")] - T0, r[-1]) for r in doc["rows"])
    assert got == [
        ("node-a", S // 2, "run_id=r1"),
        ("node-a", S + S // 2, "run_id=r1 step=1"),
        ("node-b", S, "step=77"),
    ]
